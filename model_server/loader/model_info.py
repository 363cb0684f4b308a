"""What the server reads of a model before the engine loads it: its architectures (for
candle-vllm's positional model type) and its generation_config.json (sampling defaults).

Reads config files only (a GGUF file's metadata, never its tensors); a hub id is resolved
through the hub cache without its weights, as the engine will with them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"


def model_folder(model: str | None, load_format: str = "auto") -> str | None:
    """The HF folder `model` names (a folder, its config.json, or a hub id's snapshot); None
    for a GGUF file, the embedded model or a dummy preset."""
    from model_server.loader import hub

    if model is None or not model.strip():
        return None
    path = os.path.expanduser(model.strip())
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)) if path.endswith("config.json") else None
    if load_format == "dummy":
        from model_server.loader.dummy import preset_file

        if preset_file(model) is not None:
            return None
    if hub.looks_like_hub_id(model.strip()):
        return hub.download(model.strip(), weights=False)
    return None


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        value = json.load(fh)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def model_architectures(model: str | None, load_format: str = "auto") -> list[str] | None:
    """config.json's `architectures` (a GGUF file's mapped from general.architecture); None
    where they cannot be read before loading."""
    from model_server.loader.gguf_config import GGUF_ARCHITECTURES
    from model_server.loader.gguf_file import read_gguf

    gguf = _gguf_path(model)
    if gguf is not None:
        arch = read_gguf(gguf).architecture
        return [GGUF_ARCHITECTURES[arch][1]] if arch in GGUF_ARCHITECTURES else [arch]
    config: str | None = None
    if load_format == "dummy" and model is not None:
        from model_server.loader.dummy import preset_file

        preset = preset_file(model)
        config = str(preset) if preset is not None else None
    if config is None:
        folder = model_folder(model, load_format)
        config = os.path.join(folder, "config.json") if folder is not None else None
    if config is None or not os.path.isfile(config):
        return None
    return list(_read_json(config).get("architectures") or []) or None


def _gguf_path(model: str | None) -> str | None:
    from model_server.loader.embedded import embedded_model_path

    if model is None or not model.strip():
        return embedded_model_path()
    path = os.path.expanduser(model.strip())
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
    return None


def read_generation_config(folder: str) -> dict[str, Any]:
    """The folder's generation_config.json ({} when it has none); ValueError if unreadable."""
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        return _read_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from None
