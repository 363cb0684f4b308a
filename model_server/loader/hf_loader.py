"""An HF model folder (config.json, *.safetensors, tokenizer files) -> ModelSource."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from model_server.loader.source import ModelLoadError, ModelSource

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# Any one of these means the folder ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_folder(folder: str, *, dummy: bool = False) -> ModelSource:
    config = read_hf_config(folder)
    tokenizer = load_hf_tokenizer(folder, config)
    if dummy:
        return ModelSource(config, tokenizer, folder, None, 0, format="dummy")
    files = safetensors_files(folder)
    names, dtype = _read_headers(files)
    if config_dtype(config) is None:
        set_config_dtype(config, dtype)  # from the tensors when config.json omits it

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path, keys in names.items():
            with safe_open(path, framework="pt") as f:
                for key in keys:
                    yield key, f.get_tensor(key)  # one tensor in memory at a time

    return ModelSource(config, tokenizer, folder, weights, sum(map(len, names.values())))


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: file not found") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: malformed JSON: {exc}") from exc
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(folder: str) -> transformers.PretrainedConfig:
    """AutoConfig for the folder, after checking config.json exists and parses."""
    import transformers

    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: no {CONFIG_FILE} (not a Hugging Face model folder)")
    data = read_json(path)
    if "model_type" not in data:
        raise ModelLoadError(f"{path}: no model_type field")
    try:
        # Remote-code families Wick runs natively (InternLM2, Baichuan, ChatGLM): translated
        # to their transformers equivalent, no remote code run (models/remote_code.py).
        from model_server.models.remote_code import translate_config

        translated = translate_config(data)
        if translated is not None:
            translated._name_or_path = folder
            return translated
        return transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def load_hf_tokenizer(
    folder: str, config: transformers.PretrainedConfig | None = None
) -> transformers.PreTrainedTokenizerBase | None:
    """The folder's tokenizer (fast when possible), or None when it ships none. A remote-code
    family's (`config` translated by read_hf_config) comes from its tokenizer.json where it has
    one: its own tokenizer class is remote code, which is never run."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        logger.warning("%s: no tokenizer files; serving token ids only", folder)
        return None
    import transformers

    remote = getattr(config, "remote_code_config", None) is not None
    if remote and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        # A remote-code family's tokenizer class is its own code, never run: its tokenizer.json
        # (with tokenizer_config.json's special tokens and chat template) instead.
        tokenizer_cls: Any = transformers.PreTrainedTokenizerFast
        kwargs: dict[str, Any] = {}
    else:
        tokenizer_cls = transformers.AutoTokenizer
        # A translated config spares AutoTokenizer reading config.json (it would ask to run the
        # remote code).
        kwargs = {"config": config, "trust_remote_code": False} if remote else {}
    try:
        return tokenizer_cls.from_pretrained(folder, use_fast=True, **kwargs)
    except Exception as exc:  # tokenizer loading raises anything from ValueError to OSError
        hint = (
            " (the checkpoint's tokenizer class is remote code, which Wick does not run: add a "
            "tokenizer.json, a fast tokenizer saved by transformers, to the folder)"
            if remote
            else ""
        )
        raise ModelLoadError(f"{folder}: cannot load the tokenizer{hint}: {exc}") from exc


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint shards: those the index names, else every *.safetensors in the folder."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = []
        for name in dict.fromkeys(weight_map.values()):  # shard order, deduplicated
            path = os.path.join(folder, str(name))
            if not os.path.isfile(path):
                raise ModelLoadError(f"{path}: shard listed in {INDEX_FILE} is missing")
            files.append(path)
        return files
    files = sorted(
        os.path.join(folder, f)
        for f in os.listdir(folder)
        if f.endswith(".safetensors") and not f.startswith("consolidated")
    )
    if not files:
        raise ModelLoadError(
            f"{folder}: no *.safetensors weights (other weight formats are not supported)"
        )
    return files


def config_dtype(config: transformers.PretrainedConfig) -> torch.dtype | str | None:
    # transformers 5 calls it `dtype`; 4.x calls it `torch_dtype` (5.x keeps that as an alias)
    return getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)


def set_config_dtype(config: transformers.PretrainedConfig, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if hasattr(config, "dtype"):
        config.dtype = dtype
    else:
        config.torch_dtype = dtype


def _read_headers(files: list[str]) -> tuple[dict[str, list[str]], torch.dtype | None]:
    """{file: tensor names} and the first floating tensor's dtype; parses headers only."""
    from safetensors import SafetensorError, safe_open

    names: dict[str, list[str]] = {}
    dtype = None
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                names[path] = list(f.keys())
                if dtype is None:
                    dtype = _first_float_dtype(f, names[path])
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: corrupt safetensors file: {exc}") from exc
    return names, dtype


def _first_float_dtype(handle: Any, keys: list[str]) -> torch.dtype | None:
    import torch

    for key in keys:
        dtype = handle.get_slice(key).get_dtype()  # a safetensors code: "BF16", "F32", ...
        mapped = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(dtype)
        if mapped is not None:
            return mapped
    return None
