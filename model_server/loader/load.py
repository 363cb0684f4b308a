"""`load_model_source`: one entry point that tells the kinds of model reference apart."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from model_server.loader.source import ModelLoadError, ModelSource
from model_server.settings_spec import parse_hf_overrides

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def load_model_source(
    model: str | None,
    load_format: str = "auto",
    revision: str | None = None,
    hf_overrides: str | dict[str, Any] | None = None,
) -> ModelSource:
    """Resolve `model` and return its config, tokenizer and lazy weights.

    `model`: None (the embedded SmolLM2 GGUF), a `.gguf` file, an HF folder (or its
    config.json), an HF hub id `owner/name` (downloaded at `revision` through the local cache),
    or, with `load_format="dummy"`, also a preset name (see `model_server.loader.dummy`).
    `load_format`: auto | safetensors | gguf (insist on that format) | dummy (no weights).
    `hf_overrides`: HF config fields (a dict or its JSON) set on the config once it is read.
    Raises ModelLoadError with a message naming the file and the problem.
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(
            f"unknown load format {load_format!r} (expected one of {', '.join(LOAD_FORMATS)})"
        )
    start = time.perf_counter()
    source = _resolve(model, load_format, revision)
    try:
        overrides = parse_hf_overrides(hf_overrides)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    for key, value in (overrides or {}).items():
        setattr(source.hf_config, key, value)
    logger.info(
        "model %s (%s): config, tokenizer and weight index in %.2fs",
        source.path or model,
        source.format,
        time.perf_counter() - start,
    )
    return source


def _resolve(model: str | None, load_format: str, revision: str | None) -> ModelSource:
    from model_server.loader import dummy, embedded, hub

    is_dummy = load_format == "dummy"
    if model is None or not model.strip():
        return _from_gguf(embedded.embedded_model_path(), load_format)
    path = os.path.expanduser(model.strip())
    if os.path.isfile(path):
        if path.endswith(".gguf") or _has_gguf_magic(path):
            return _from_gguf(path, load_format)
        if os.path.basename(path) == "config.json":
            return _from_folder(os.path.dirname(os.path.abspath(path)), load_format)
        if is_dummy and path.endswith(".json"):
            return dummy.dummy_from_config_file(path)
        raise ModelLoadError(
            f"{path}: unsupported model file (expected a .gguf file or a Hugging Face folder)"
        )
    if os.path.isdir(path):
        return _from_folder(path, load_format)
    if is_dummy and (preset := dummy.preset_file(model)) is not None:
        return dummy.dummy_from_config_file(str(preset))
    if hub.looks_like_hub_id(model.strip()):
        if load_format == "gguf":
            raise ModelLoadError(f"{model}: load_format gguf needs a local .gguf file path")
        folder = hub.download(model.strip(), revision, weights=not is_dummy)
        return _from_folder(folder, load_format)
    presets = ", ".join(dummy.preset_names())
    raise ModelLoadError(
        f"no such file or folder: {model} (nor an `owner/name` hub id; dummy presets: {presets})"
    )


def _from_gguf(path: str, load_format: str) -> ModelSource:
    from model_server.loader.gguf_loader import load_gguf

    if load_format == "safetensors":
        raise ModelLoadError(f"{path}: load_format safetensors, but this is a GGUF file")
    return load_gguf(path, dummy=load_format == "dummy")


def _from_folder(folder: str, load_format: str) -> ModelSource:
    from model_server.loader.hf_loader import CONFIG_FILE, load_hf_folder

    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        # A folder holding one GGUF (e.g. a downloaded llama.cpp model): load that file.
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if len(ggufs) == 1 and load_format != "safetensors":
            return _from_gguf(os.path.join(folder, ggufs[0]), load_format)
        if len(ggufs) > 1:
            raise ModelLoadError(
                f"{folder}: no {CONFIG_FILE}, and several .gguf files ({', '.join(ggufs)}): "
                "pass one of them"
            )
    if load_format == "gguf":
        raise ModelLoadError(f"{folder}: load_format gguf needs a .gguf file, got a folder")
    source = load_hf_folder(folder, dummy=load_format == "dummy")
    if source.weights is None and source.tokenizer is None:
        from model_server.loader.dummy import fallback_tokenizer

        source.tokenizer = fallback_tokenizer(source.hf_config)
    return source


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
