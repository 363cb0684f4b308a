"""The model server's settings, each declared once: type, default, help, flag, environment names.

Built from `SETTINGS`: the argparse flags of every subcommand (`add_arguments`), the fields of
the pydantic `ServerSettings` (settings.py), `EngineConfig`'s defaults (config.py) and
docs/configuration.md (`configuration_markdown`; rewrite it with
`python -m model_server.settings_spec docs/configuration.md`).

Imports nothing heavy (no torch, no pydantic): `--help` must stay instant, and `generate`,
`worker` and `bench` run where only the engine's dependencies are installed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from model_server.settings_aliases import aliases_markdown

Group = Literal["engine", "server"]

# Engine settings are flags of every command that runs an engine; only `serve` has the server
# settings and reads the environment (LLM_* and OPEA names) under its flags.
GROUP_COMMANDS: dict[Group, tuple[str, ...]] = {
    "engine": (
        "serve",
        "generate",
        "worker",
        "bench throughput",
        "bench latency",
        "bench structured",
    ),
    "server": ("serve",),
}

# The served name of the embedded default model (its Hugging Face id).
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# ------------------------------------------------------------------------------- value parsers

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "ki": 1024,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mi": 1024**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gi": 1024**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_size(text: str | int | float) -> int:
    """Parse a memory size like `2GiB`, `512MiB`, `1.5GB`, or a bare number of GiB.

    A bare number is read as GiB, like vLLM's `VLLM_CPU_KVCACHE_SPACE=4`, up to 4096; past that
    it is refused: `8192` meant as MB (candle-vllm's `--mem`) would otherwise be 8 TiB, and
    meant as bytes it holds no KV block.
    """
    if isinstance(text, (int, float)):
        return _bare_size(float(text), text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse memory size {text!r}: use e.g. 2GiB, 512MiB or 1.5GB")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "":
        return _bare_size(number, text)
    return int(number * _SIZE_UNITS[unit])


def _bare_size(number: float, text: object) -> int:
    if number > 4096:
        raise ValueError(
            f"memory size {text!r} has no unit: a bare number is GiB (up to 4096); write the "
            f"unit, e.g. {int(number)}MiB or {int(number)}B"
        )
    return int(number * 1024**3)


def parse_byte_count(text: str | int) -> int:
    """A byte count like `32MiB`, `512KiB` or `1.5MB`; a bare number is bytes (not GiB)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}: use e.g. 32MiB, 512KiB or 1000000 (bytes)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


def format_byte_count(value: int) -> str:
    """`33554432` -> `32MiB`: whole units `parse_byte_count` reads back, else bytes."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value} bytes"


def parse_device_ids(text: str | list[int] | None) -> list[int] | None:
    """`0,1` -> [0, 1] (device indices, like candle-vllm's `--d 0,1`); empty -> None."""
    if text is None:
        return None
    if isinstance(text, list):
        ids = text
    else:
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        try:
            ids = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"device ids must be comma-separated integers, got {text!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"device ids must be distinct non-negative integers, got {text!r}")
    return ids or None


def check_device_count(device_ids: list[int] | None, tensor_parallel_size: int) -> None:
    """More device ids than tensor-parallel ranks is refused: each rank takes one device, so
    the extra ones would sit idle while the user believes the model is sharded over them.
    (Fewer ids than ranks is checked per node, where NNODES is known: worker.check_device_ids.)
    """
    if device_ids is not None and len(device_ids) > tensor_parallel_size:
        ids, n = ",".join(map(str, device_ids)), len(device_ids)
        raise ValueError(
            f"--device-ids {ids} names {n} devices but --tensor-parallel-size is "
            f"{tensor_parallel_size} (one device per rank): add -tp {n} to shard the model over "
            f"them, or name {tensor_parallel_size} device(s)"
        )


def parse_served_model_names(text: str | list[str] | None) -> str | None:
    """`a b`, `a,b` or the flag's list -> `a,b` (the canonical text); empty -> None.

    Model names (hub ids, paths, aliases) hold neither commas nor spaces, so both separate."""
    if text is None:
        return None
    parts = text if isinstance(text, list) else [text]
    names = [n for part in parts for n in re.split(r"[,\s]+", str(part)) if n]
    return ",".join(dict.fromkeys(names)) or None


def served_model_names(text: str | None) -> list[str]:
    """The names of `--served-model-name`'s canonical text, the reported one first."""
    return text.split(",") if text else []


def parse_hf_overrides(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`{"num_hidden_layers": 4}` (a JSON object of HF config fields) -> dict; empty -> None."""
    if text is None or isinstance(text, dict):
        return text or None
    if not str(text).strip():
        return None
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"hf_overrides must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"hf_overrides must be a JSON object of config fields, got {text!r}")
    return value or None


# vLLM's KVEventsConfig fields and defaults (`--kv-events-config`); publisher None: "zmq" when
# events are enabled, else "null".
KV_EVENTS_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}


def parse_kv_events_config(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`--kv-events-config` (a JSON object of vLLM's KVEventsConfig fields) -> every field,
    checked; None when events are off. Unknown fields and other publishers are refused."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    import json

    if isinstance(text, dict):
        value: Any = text
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_events_config must be a JSON object, got {text!r}")
    unknown = sorted(set(value) - set(KV_EVENTS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"kv_events_config: unknown field(s) {unknown}; Wick takes vLLM's "
            f"{sorted(KV_EVENTS_DEFAULTS)}"
        )
    config = {**KV_EVENTS_DEFAULTS, **value}
    if not isinstance(config["enable_kv_cache_events"], bool):
        raise ValueError("kv_events_config: enable_kv_cache_events must be true or false")
    if config["publisher"] is None:
        config["publisher"] = "zmq" if config["enable_kv_cache_events"] else "null"
    if config["publisher"] not in ("zmq", "null"):
        raise ValueError(
            f"kv_events_config: publisher {config['publisher']!r} is not one Wick has (zmq, null)"
        )
    for key in ("endpoint", "topic"):
        if not isinstance(config[key], str):
            raise ValueError(f"kv_events_config: {key} must be a string")
    if config["replay_endpoint"] is not None and not isinstance(config["replay_endpoint"], str):
        raise ValueError("kv_events_config: replay_endpoint must be a string or null")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise ValueError(f"kv_events_config: {key} must be a positive integer")
    if not config["enable_kv_cache_events"] or config["publisher"] == "null":
        return None
    if not config["endpoint"].startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"kv_events_config: endpoint {config['endpoint']!r} must be tcp://, ipc:// or inproc://"
        )
    return config


# vLLM's SpeculativeConfig keys Wick takes (`--speculative-config`). `disable_by_batch_size`:
# speculation runs in a step only while fewer requests than this are running (vLLM's meaning),
# so that wide batches, which are compute-bound, keep their throughput.
# `model` (method draft_model): a smaller model of the target's tokenizer that drafts
# (engine/execution/draft_model.py); `draft_tensor_parallel_size` is taken only as 1.
SPECULATIVE_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
)
SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_ONLY_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor _max is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
MAX_SPECULATIVE_TOKENS = 32


def parse_speculative_config(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """`--speculative-config` (a JSON object of vLLM's SpeculativeConfig keys) -> every key,
    checked and defaulted; None when speculation is off. Methods other than ngram and
    draft_model (implied by `model`), unknown keys, keys of the other method and bad numbers
    are refused, each error naming the key. A draft model's own checks (vocabulary, context,
    loading) are made when it loads (engine/execution/draft_model.py)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    import json

    if isinstance(text, dict):
        value: Any = text
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "draft_model"  # vLLM's reading of a config that names a model
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported; Wick speculates with "
            "ngram (prompt lookup) or draft_model (a smaller model of the same tokenizer, "
            'named by "model")'
        )
    unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported key(s) {unknown}; Wick takes {list(SPECULATIVE_KEYS)}"
        )
    model = value.get("model")
    if method == "ngram" and model is not None:
        raise ValueError(
            "speculative_config: model names a draft model, which method ngram does not use "
            '(drop "model", or use method draft_model)'
        )
    if method == "ngram" and value.get("draft_tensor_parallel_size") is not None:
        raise ValueError(
            "speculative_config: draft_tensor_parallel_size is a draft model's; method ngram "
            "has none"
        )
    if method == "draft_model":
        if not isinstance(model, str) or not model.strip():
            raise ValueError(
                'speculative_config: method draft_model needs "model": the draft\'s path or hub id'
            )
        given = sorted(set(NGRAM_ONLY_KEYS) & set(value))
        if given:
            raise ValueError(f"speculative_config: {given} are method ngram's, not draft_model's")
        tp = value.get("draft_tensor_parallel_size", 1)
        if tp != 1 or isinstance(tp, bool):
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size must be 1 (the draft runs on "
                f"the one rank that samples), got {tp!r}"
            )

    def integer(key: str, low: int, high: int | None = None) -> int:
        v = value[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < low or (high and v > high):
            bound = f"from {low} to {high}" if high else f"at least {low}"
            raise ValueError(f"speculative_config: {key} must be an integer {bound}, got {v!r}")
        return v

    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    config: dict[str, Any] = {"method": method, "model": model.strip() if model else None}
    config["num_speculative_tokens"] = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    lo = integer("prompt_lookup_min", 1) if value.get("prompt_lookup_min") is not None else None
    hi = integer("prompt_lookup_max", 1) if value.get("prompt_lookup_max") is not None else None
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    config["prompt_lookup_min"] = lo if lo is not None else hi
    config["prompt_lookup_max"] = hi if hi is not None else lo
    if config["prompt_lookup_min"] > config["prompt_lookup_max"]:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({config['prompt_lookup_min']}) must not "
            f"exceed prompt_lookup_max ({config['prompt_lookup_max']})"
        )
    config["disable_by_batch_size"] = (
        integer("disable_by_batch_size", 2)
        if value.get("disable_by_batch_size") is not None
        else DEFAULT_DISABLE_BY_BATCH_SIZE
    )
    return config


# Applied at load (models/quantization.py).
QUANTIZATION_METHODS = ("int8",)
# Names of a checkpoint's own format (vLLM-GCU's --quantization gptq|awq|w8a16): checked
# against its quantization_config when it loads (layers/quantization/wna16.py
# `resolve_quantization`); w8a16 on a float checkpoint is int8 at load.
CHECKPOINT_QUANTIZATION_METHODS = ("gptq", "awq", "w8a16")
# Spellings of "no quantization" (settings, env files, Helm values).
_NONE = ("", "none", "auto")


def parse_quantization(value: str | None) -> str | None:
    """The method named by a flag or setting (None: no quantization); ValueError if unknown."""
    if value is None or value.strip().lower() in _NONE:
        return None
    method = value.strip().lower()
    if method == "gguf":
        # GGUF files are read (and dequantized) by the loader whatever this says.
        return None
    known = QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION_METHODS
    if method not in known:
        raise ValueError(
            f"quantization {value!r} is not supported; choose one of: {', '.join(known)} (or none)"
        )
    return method


# Checks of a setting's typed value; each raises ValueError naming the setting and the value.


def _check_tp(value: int) -> None:
    if value < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {value}")


GGUF_WEIGHTS_MODES = ("auto", "quantized", "dequantized", "mixed")


def _check_gguf_weights(value: str) -> None:
    if value not in GGUF_WEIGHTS_MODES:
        raise ValueError(f"gguf_weights {value!r} is not one of {', '.join(GGUF_WEIGHTS_MODES)}")


# --kv-cache-dtype values (kernels/kv_cache_dtype.py maps them to storage).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def _check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {value!r} is not supported; choose one of: "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )


# --quantization-param-path's kv_cache.dtype -> the --kv-cache-dtype its scales are for.
KV_SCALES_DTYPES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8"}


def read_kv_cache_scales(path: str) -> tuple[str, dict[int, dict[int, float]]]:
    """vLLM's --quantization-param-path file, strictly: `{"model_type": str | null, "kv_cache":
    {"dtype": "float8_e4m3fn", "scaling_factor": {TP rank: {layer: scale}}}}` (vLLM's
    QuantParamSchema, as AMMO's and AMD's quantizers write it; dtype also float8_e5m2 or int8,
    for those caches): ranks 0..R-1 each with layers 0..L-1, every scale a positive finite
    number (a stored value reads back as code * scale). Returns (dtype, scales); ValueError
    (one line naming the file and the field) for anything else."""
    import json
    import math

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what} (expected vLLM's KV cache scales JSON)")

    def index(key: str, what: str) -> int:
        if not key.isdigit():
            raise bad(f"{what} {key!r} is not a non-negative integer")
        return int(key)

    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad("the top level is not an object")
    unknown = sorted(set(data) - {"model_type", "kv_cache"})
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}")
    if not isinstance(data.get("model_type"), str | None):
        raise bad("model_type is not a string")
    kv = data.get("kv_cache")
    if not isinstance(kv, dict):
        raise bad("no kv_cache object")
    unknown = sorted(set(kv) - {"dtype", "scaling_factor"})
    if unknown:
        raise bad(f"unknown field kv_cache.{unknown[0]}")
    dtype = kv.get("dtype")
    if dtype not in KV_SCALES_DTYPES:
        raise bad(f"kv_cache.dtype is {dtype!r}, not one of {', '.join(KV_SCALES_DTYPES)}")
    ranks = kv.get("scaling_factor")
    if not isinstance(ranks, dict) or not ranks:
        raise bad("kv_cache.scaling_factor is not a non-empty object of TP ranks")
    scales: dict[int, dict[int, float]] = {}
    for rank_key, layers in ranks.items():
        rank = index(rank_key, "TP rank")
        where = f"kv_cache.scaling_factor.{rank_key}"
        if not isinstance(layers, dict) or not layers:
            raise bad(f"{where} is not a non-empty object of layers")
        scales[rank] = {}
        for layer_key, value in layers.items():
            layer = index(layer_key, f"{where}: layer")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise bad(f"{where}.{layer_key} is {value!r}, not a positive number")
            scales[rank][layer] = float(value)
        if sorted(scales[rank]) != list(range(len(scales[rank]))):
            raise bad(f"{where}: the layers are not 0..{len(scales[rank]) - 1}")
    if sorted(scales) != list(range(len(scales))):
        raise bad(f"kv_cache.scaling_factor: the TP ranks are not 0..{len(scales) - 1}")
    if len({len(layers) for layers in scales.values()}) > 1:
        raise bad("kv_cache.scaling_factor: the TP ranks have different numbers of layers")
    return dtype, scales


def _check_quantization_param_path(value: str | None) -> None:
    """The file reads as vLLM's KV cache scales (its match with --kv-cache-dtype, the ranks
    and the layers are checked when the engine starts)."""
    if value is None or not str(value).strip():
        return
    read_kv_cache_scales(str(value).strip())


class _CheckedAtParse(argparse.Action):
    """A flag whose setting's check runs while the command line parses: a bad value ends the
    command with one `error:` line and exit 2 (argparse's status for a bad argument), without
    the usage block."""

    check: Callable[[Any], None]

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        try:
            self.check(values)
        except ValueError as exc:
            parser.exit(2, f"error: {self.option_strings[0]}: {exc}\n")
        setattr(namespace, self.dest, values)


def _check_port(value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"port must be in 0-65535, got {value}")


def _check_drain_timeout(value: float) -> None:
    if value < 0:
        raise ValueError(f"drain_timeout must be non-negative, got {value}")


TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


def _check_tool_call_parser(value: str) -> None:
    if value not in TOOL_CALL_PARSERS:
        known = ", ".join(TOOL_CALL_PARSERS)
        raise ValueError(f"tool_call_parser {value!r} is not known; choose one of: {known}")


REASONING_PARSERS = ("none", "auto", "qwen3", "deepseek_r1")


def _check_reasoning_parser(value: str) -> None:
    if value not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"reasoning_parser {value!r} is not known; choose one of: {known}")


def parse_list(text: str | list[str] | None) -> str | None:
    """A list setting (`--allowed-origins`, ...) -> its canonical comma-joined text; empty ->
    None. Takes vLLM's JSON list (`'["http://a", "http://b"]'`), commas or spaces, or the
    flag's list: origins, methods and header names hold neither commas nor spaces."""
    if text is None:
        return None
    parts = text if isinstance(text, list) else [text]
    items: list[str] = []
    for part in parts:
        part = str(part).strip()
        if part.startswith("["):
            import json

            try:
                value = json.loads(part)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of strings: {part!r}: {exc}") from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"not a JSON list of strings: {part!r}")
            items += [v.strip() for v in value if v.strip()]
        else:
            items += [v for v in re.split(r"[,\s]+", part) if v]
    return ",".join(dict.fromkeys(items)) or None


def split_list(text: str | None) -> list[str]:
    """The items of a list setting's canonical text."""
    return text.split(",") if text else []


# --lora-modules: one entry per adapter, as vLLM takes them: `name=path`, or a JSON object
# {"name", "path", "base_model_name"} (a JSON list of those too).
LORA_MODULE_FIELDS = ("name", "path", "base_model_name")
# vLLM's ranks (--max-lora-rank takes one of them).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def parse_lora_modules(text: str | list[str] | None) -> str | None:
    """`--lora-modules` (`name=path` entries, vLLM's JSON objects or a JSON list of them; the
    flag's list, spaces between entries) -> its canonical text, a JSON list of objects with
    `name`, `path` and `base_model_name` (null: the served model); empty -> None. Idempotent:
    the canonical text parses to itself. ValueError for a malformed entry or a repeated name."""
    import json

    if text is None:
        return None
    parts = text if isinstance(text, list) else [text]
    entries: list[dict[str, Any]] = []

    def add(obj: object, raw: str) -> None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError(f"lora_modules: {raw!r} is not name=path nor a JSON object with name")
        unknown = sorted(set(obj) - set(LORA_MODULE_FIELDS))
        if unknown:
            raise ValueError(f"lora_modules: unknown field(s) {unknown} in {raw!r}")
        name, path = obj["name"].strip(), obj.get("path")
        if not name or not isinstance(path, str) or not path.strip():
            raise ValueError(f"lora_modules: {raw!r} needs a non-empty name and path")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"lora_modules: base_model_name must be a string in {raw!r}")
        entries.append({"name": name, "path": path.strip(), "base_model_name": base})

    for part in parts:
        part = str(part).strip()
        if part.startswith(("[", "{")):
            try:
                value = json.loads(part)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: not valid JSON: {part!r}: {exc}") from None
            for obj in value if isinstance(value, list) else [value]:
                add(obj, part)
            continue
        for item in part.split():
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            add({"name": name, "path": path}, item)
    names = [e["name"] for e in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"lora_modules: adapter name(s) {repeated} given more than once")
    return json.dumps(entries, separators=(",", ":")) if entries else None


def _check_max_lora_rank(value: int) -> None:
    if value not in LORA_RANKS:
        raise ValueError(
            f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))} (vLLM's), got {value}"
        )


# scheme://host[:port], what a browser sends as Origin: no path, no trailing slash.
_ORIGIN_RE = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s]+$", re.IGNORECASE)


def _check_allowed_origins(value: str) -> None:
    for origin in split_list(value):
        if origin != "*" and not _ORIGIN_RE.match(origin):
            raise ValueError(
                f"allowed_origins: {origin!r} is not an origin: write scheme://host[:port] "
                "without a path or trailing slash (what browsers send), or *"
            )


# --max-waiting-requests auto: this many full batches (--max-num-seqs) may wait behind the
# running one.
WAITING_BATCHES = 4
_DEFAULT_MAX_NUM_SEQS = 256


def parse_max_waiting_requests(value: str | int | None) -> int | None:
    """`auto` -> None (resolved by `resolve_max_waiting_requests`), else a count."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"max_waiting_requests must be auto or a count (0: no limit), got {value!r}"
        ) from None


def resolve_max_waiting_requests(value: int | None, max_num_seqs: int) -> int:
    """The waiting limit in engine requests: `auto` (None) is WAITING_BATCHES full batches."""
    return WAITING_BATCHES * max_num_seqs if value is None else value


def _non_negative(name: str) -> Callable[[int], None]:
    def check(value: int) -> None:
        if value < 0:
            raise ValueError(f"{name} must be non-negative (0: no limit), got {value}")

    return check


def _at_least(name: str, low: float) -> Callable[[float], None]:
    def check(value: float) -> None:
        if not value >= low:  # NaN too
            raise ValueError(f"{name} must be at least {low:g}, got {value}")

    return check


def _positive(name: str) -> Callable[[float], None]:
    def check(value: float) -> None:
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")

    return check


def _check_top_p(value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


# The CPU kernels' settings (kernels/cpu/). Their variables are the WICK_* names the kernels
# have always read; every command reads them when the flag is not given (`Setting.everywhere`).
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_on_off(text: str | bool) -> bool:
    """`1/true/yes/on` -> True, `0/false/no/off` -> False (any case); ValueError otherwise."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"expected on or off (1/0, true/false, yes/no), got {text!r}")


CPU_AUTO_DTYPES = ("measure", "bfloat16", "float32")


def parse_cpu_auto_dtype(text: str) -> str:
    value = str(text).strip().lower()
    value = {"bf16": "bfloat16", "fp32": "float32"}.get(value, value)
    if value not in CPU_AUTO_DTYPES:
        raise ValueError(
            f"cpu_auto_dtype {text!r} is not one of {', '.join(CPU_AUTO_DTYPES)} (bf16, fp32)"
        )
    return value


GGUF_INT8_DOT_MODES = ("auto", "on", "off")


def parse_gguf_int8_dot(text: str) -> str:
    value = str(text).strip().lower()
    if value in _TRUE or value in _FALSE:
        value = "on" if value in _TRUE else "off"
    if value not in GGUF_INT8_DOT_MODES:
        raise ValueError(
            f"gguf_int8_dot {text!r} is not one of {', '.join(GGUF_INT8_DOT_MODES)} "
            "(1/0, true/false too)"
        )
    return value


# kernels/cpu/isa.py's ISA_NAMES, best first (which imports nothing heavy, but a test keeps them
# equal so that --help needs no kernel module).
CPU_ISAS = ("auto", "avx512_bf16", "avx512", "avx2", "generic")


def parse_cpu_isa(text: str) -> str:
    value = str(text).strip().lower()
    if value not in CPU_ISAS:
        raise ValueError(f"cpu_isa {text!r} is not one of {', '.join(CPU_ISAS)}")
    return value


# -------------------------------------------------------------------------------- declarations


@dataclass(slots=True, frozen=True)
class Setting:
    """One setting. `name` is the `ServerSettings`/`EngineConfig` field and the argparse dest;
    the flag is `--name-with-dashes`, the environment variable `LLM_NAME` unless `env` says."""

    name: str
    type: type  # str | int | float | bool; a None default makes it optional
    default: Any
    help: str  # what it does; the default is appended from `default_text`
    group: Group
    default_text: str | None = None  # how help and docs say the default; None: from `default`
    env: str | None = None
    opea: tuple[str, ...] = ()  # OPEA's names, read when the LLM_* one is unset
    aliases: tuple[str, ...] = ()  # short flags (-tp, -q)
    choices: tuple[str, ...] | None = None  # enforced on the flag only, as before
    parse: Callable[[Any], Any] | None = None  # user text -> value (flag and environment)
    check: Callable[[Any], None] | None = None  # ValueError for a bad value (settings layer)
    negatable: bool = True  # a bool flag gets --no-<flag>; False: a plain store_true switch
    nargs: str | None = None  # argparse's, for a flag taking several values (`parse` joins them)
    secret: bool = False  # kept out of reprs (pydantic SecretStr)
    # Read by every command, not only `serve`: a WICK_* variable of the kernels. Its default is
    # None ("not given"), so that the variable still decides under commands that read no
    # environment and engines built in code (`resolve_setting`); `unset` is the value when
    # neither flag nor variable gives one.
    everywhere: bool = False
    unset: Any = None
    env_negated: bool = False  # a bool whose variable says the opposite (WICK_NO_GGUF_CACHE=1)
    check_flag: bool = False  # `check` runs on the flag while parsing (exit 2, one line)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_names(self) -> tuple[str, ...]:
        """The variables that set it, the winning one first."""
        return (self.env or f"LLM_{self.name.upper()}", *self.opea)

    @property
    def default_help(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)

    def help_text(self, *, env: bool) -> str:
        text = f"{self.help} Default: {self.default_help}"
        text += "" if text.endswith(".") else "."
        return f"{text} Env: {', '.join(self.env_names)}." if env or self.everywhere else text

    def from_env_text(self, text: str) -> Any:
        """The value a variable's text means (parsed and checked); ValueError naming both."""
        try:
            if self.type is bool:
                value = parse_on_off(text)
                value = not value if self.env_negated else value
            elif self.parse is not None:
                value = self.parse(text)
            else:
                value = self.type(text)
            if self.check is not None:
                self.check(value)
        except ValueError as exc:
            raise ValueError(f"{self.env_names[0]}={text!r} ({self.flag}): {exc}") from None
        return value

    def env_text(self, value: Any) -> str:
        """The variable's text for `value` (what `from_env_text` reads back)."""
        if self.type is bool:
            return "1" if bool(value) != self.env_negated else "0"
        return str(value)


SETTINGS: tuple[Setting, ...] = (
    # --- engine: every command that runs an engine; names mirror `vllm serve`
    Setting(
        "model",
        str,
        None,
        "HF folder, .gguf file, HF hub id, or (with --load-format dummy) a preset name such as "
        "qwen3-0.6b / llama-3.1-8b.",
        "engine",
        default_text="the embedded SmolLM2-135M-Instruct GGUF",
        opea=("LLM_VLLM_MODEL_NAME",),
    ),
    Setting(
        "load_format",
        str,
        "auto",
        "auto: real weights; dummy: random weights for the model's config (benchmarks).",
        "engine",
        choices=("auto", "dummy"),
    ),
    Setting(
        "dtype",
        str,
        "auto",
        "float32, bfloat16, float16, or auto: on cpu bfloat16 where the model's own linear "
        "shapes time faster in bf16 than in float32 on this machine (timed at the first start "
        "with the kernels the tuner chooses from, cached; see --cpu-auto-dtype), else float32; "
        "timed with native bf16 (avx512_bf16 or AMX), and without it only for a checkpoint "
        "stored in bf16 (the native kernels read its weights as they are; torch's own bf16 "
        "runs 3-10x slower there), float32 otherwise; bfloat16 on accelerators (float16 on "
        "CUDA devices without bf16).",
        "engine",
        opea=("VLLM_DTYPE",),
    ),
    Setting(
        "quantization",
        str,
        None,
        "int8: weight-only int8 quantization at load (per output channel; activations, norms, "
        "embeddings and the KV cache stay in --dtype): 4x less weight memory than float32 and "
        "faster few-row decode steps on CPU; on cuda a Triton w8a16 kernel; on gcu and hpu the "
        "portable torch matmul (dequantizes the weight on every call: slower than float). "
        "GGUF files are read in their own format (see --gguf-weights). GPTQ and AWQ checkpoints "
        "(an HF folder whose config.json has a quantization_config) are served kept quantized "
        "without this flag; gptq, awq or w8a16 (vLLM-GCU's names) only check that the "
        "checkpoint is that (w8a16: 8-bit weights; on a float checkpoint it is int8), and a "
        "conflict is an error before the weights load.",
        "engine",
        default_text="none",
        aliases=("-q",),
        check=parse_quantization,  # which device supports it is checked when the engine starts
    ),
    Setting(
        "gguf_weights",
        str,
        "auto",
        "How a GGUF file's quantized matrices load: quantized (kept in their GGUF blocks, Q4_0 "
        "to Q8_0 and Q2_K to Q6_K, decoded by the matmul as it reads them, with activations "
        "rounded to int8 per 32 values where that times faster (--gguf-int8-dot): weight "
        "memory about the file's size, faster batch-1 decode, slower batches of 8 and more; cpu "
        "only), dequantized (float weights in --dtype), mixed (float weights, and the blocks "
        "kept beside those whose blocks time faster at few rows, which then run them there on "
        "their float kernel without int8 rounding; the extra memory is logged; cpu, linear "
        "tuning on, one rank: in bfloat16 a request's tokens then depend a little on how many "
        "rows its steps had, as the blocks hold the weights unrounded), or auto (mixed under "
        "--dtype float32, where both hold the same values, else dequantized; README's GGUF "
        "section has the figures). --dtype stays the activation dtype either way; other "
        "checkpoint formats ignore it.",
        "engine",
        choices=GGUF_WEIGHTS_MODES,
        check=_check_gguf_weights,
    ),
    Setting(
        "kv_cache_dtype",
        str,
        "auto",
        "KV cache storage: auto (the model's --dtype), bfloat16 or float16 (a float cache of that "
        "dtype whatever the model's), int8, fp8_e4m3 or fp8_e5m2 (quantized K/V with one float32 "
        "scale per token and KV head beside the blocks: about 1.9x the blocks of a bf16 cache "
        "for the same --kv-cache-memory at head_dim 64). Every attention backend reads them; "
        "DeepSeek's latent cache takes the float ones only.",
        "engine",
        check=_check_kv_cache_dtype,
    ),
    Setting(
        "quantization_param_path",
        str,
        None,
        "vLLM's (and vLLM-GCU's) file of static per-layer KV cache scales (JSON: "
        "kv_cache.dtype float8_e4m3fn, float8_e5m2 or int8, kv_cache.scaling_factor per TP rank "
        "and layer, as AMMO's or AMD's quantizer writes it): every K and V row a layer stores "
        "takes the layer's scale instead of its own max|x| / qmax (values past qmax x scale "
        "clamp). Needs the matching --kv-cache-dtype (fp8_e4m3, fp8_e5m2, int8), one scale per "
        "layer and one set per --tensor-parallel-size rank; anything else is one error line. "
        "Without it each row gets its own scale, which needs no calibration.",
        "engine",
        default_text="none",
        check=_check_quantization_param_path,
        check_flag=True,
    ),
    Setting(
        "device",
        str,
        "cpu",
        "cpu, cuda, gcu (Enflame, needs torch_gcu), hpu (Intel Gaudi, needs habana_frameworks) "
        "or auto (the best present: cuda > hpu > gcu > cpu).",
        "engine",
    ),
    Setting(
        "device_ids",
        str,  # the raw "0,1"; EngineConfig.from_attrs parses it
        None,
        "Comma-separated device indices for this node's ranks, e.g. 0,1 (after the vendor's "
        "CUDA_VISIBLE_DEVICES / TOPS_VISIBLE_DEVICES / HABANA_VISIBLE_MODULES), one per "
        "tensor-parallel rank: more ids than --tensor-parallel-size is an error (--device-ids "
        "0,1 needs -tp 2), never a silent one-device server.",
        "engine",
        default_text="0, 1, ...",
        check=parse_device_ids,
    ),
    Setting(
        "tensor_parallel_size",
        int,
        1,
        "Ranks (devices) to shard the model over; more than one node through MASTER_ADDR, "
        "MASTER_PORT, NNODES and NODE_RANK.",
        "engine",
        env="LLM_TP_SIZE",
        opea=("VLLM_TP_SIZE",),
        aliases=("-tp",),
        check=_check_tp,
    ),
    Setting(
        "distributed_executor_backend",
        str,
        "mp",
        "How tensor-parallel ranks start: mp (worker processes on this node, other nodes through "
        "MASTER_ADDR/NNODES/NODE_RANK and `worker`) or ray (Ray actors in a placement group of "
        "the Ray cluster RAY_ADDRESS names, else a local one; needs `pip install ray` and "
        "--tensor-parallel-size > 1).",
        "engine",
        choices=("mp", "ray"),
    ),
    Setting("seed", int, 0, "Seed for dummy weights.", "engine"),
    Setting(
        "hf_overrides",
        str,  # the raw JSON; the loader parses it
        None,
        "JSON object of HF config fields set after the config is read, as vLLM's flag, e.g. "
        "'{\"num_hidden_layers\": 4}' to benchmark a --load-format dummy preset at a small size "
        "(with real weights, only fields that leave the weights' shapes alone).",
        "engine",
        default_text="none",
        check=parse_hf_overrides,
    ),
    Setting(
        "max_model_len",
        int,
        None,
        "Longest prompt + output in tokens.",
        "engine",
        default_text="the model's context length",
    ),
    Setting(
        "max_num_seqs",
        int,
        _DEFAULT_MAX_NUM_SEQS,
        "Most sequences in one step.",
        "engine",
        opea=("VLLM_MAX_NUM_SEQS",),
    ),
    Setting(
        "max_num_batched_tokens",
        int,
        None,
        "Token budget of one step, shared by decodes and prefill chunks (pooling models: padded "
        "input tokens per step).",
        "engine",
        default_text="512 on CPU, 2048 on accelerators; 8192 for pooling models",
    ),
    Setting("block_size", int, 16, "Tokens per KV cache block.", "engine"),
    Setting(
        "kv_cache_memory",
        int,  # bytes
        None,
        "KV cache budget, e.g. 2GiB or 512MiB (a bare number is GiB).",
        "engine",
        default_text="2GiB on CPU",
        opea=("VLLM_CPU_KVCACHE_SPACE",),
        parse=parse_size,
    ),
    Setting(
        "enable_prefix_caching",
        bool,
        True,
        "Reuse the KV blocks of shared prompt prefixes.",
        "engine",
    ),
    Setting(
        "kv_events_config",
        str,  # the raw JSON; EngineConfig.kv_events() reads it
        None,
        "Publish the prefix cache's KV events as vLLM does, for KV-aware routers: a JSON object "
        "of vLLM's KVEventsConfig fields (enable_kv_cache_events, publisher zmq|null, endpoint, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic), e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'. Needs prefix caching.',
        "engine",
        default_text="off",
        check=parse_kv_events_config,
    ),
    Setting(
        "speculative_config",
        str,  # the raw JSON; SpeculativeConfig.parse (config.py) reads it
        None,
        "Speculative decoding as vLLM's --speculative-config: a JSON object, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' (n-gram prompt lookup), or a draft model: '
        '\'{"model": "PATH_OR_HUB_ID", "num_speculative_tokens": 4}\' (method draft_model: a '
        "smaller model of the same tokenizer and vocabulary size, loaded as the target is, in "
        "its dtype, its KV cache sharing the target's block budget; "
        "draft_tensor_parallel_size 1 only). Output is the "
        "same as without speculation, greedy or seeded; requests with penalties, min_tokens "
        "still due or a grammar decode plainly, and only steps with fewer than "
        "disable_by_batch_size (default 4) running requests speculate; a request whose drafts "
        "keep being rejected proposes fewer, then none for a while. Not with tensor "
        "parallelism.",
        "engine",
        default_text="off",
        check=parse_speculative_config,
        check_flag=True,
    ),
    Setting(
        "enable_chunked_prefill",
        bool,
        True,
        "Split long prompts across steps under the token budget.",
        "engine",
    ),
    Setting(
        "attention_backend",
        str,
        None,
        "Attention implementation: torch (portable PyTorch), cpu (native C paged attention for "
        "decodes and prefills in fp32 and bf16, built on first use for the CPU's ISA; falls back "
        "to torch, with a warning, without a C compiler), triton (GPU).",
        "engine",
        default_text="the device's (cpu on CPU, triton on CUDA)",
        # layers.attention.ATTENTION_BACKENDS (which imports torch); a test keeps them equal.
        choices=("torch", "cpu", "triton"),
    ),
    Setting(
        "enforce_eager",
        bool,
        False,
        "Never capture CUDA graphs: decode steps run eagerly (CUDA only; by default they replay a "
        "graph captured per batch-size bucket 1, 2, 4, 8, 16, ... up to max_num_seqs, at most "
        "512).",
        "engine",
        negatable=False,
    ),
    Setting(
        "gpu_memory_utilization",
        float,
        0.9,
        "Share of each accelerator's memory this server may use, in (0, 1]. At startup a forward "
        "of the largest step (--max-num-batched-tokens) is profiled, and the KV cache gets what "
        "the share leaves after weights, activations and runtime memory; memory in use before "
        "startup is not counted (nor taken). Unused with --kv-cache-memory and on CPU.",
        "engine",
    ),
    Setting("num_threads", int, None, "CPU threads.", "engine", default_text="all available cores"),
    # --- engine, LoRA adapters (vLLM's flags; model_server/lora/)
    Setting(
        "enable_lora",
        bool,
        False,
        "Serve LoRA adapters (PEFT folders) of the base model: a request picks one by its "
        "`model` name; requests for different adapters and for the base model run in one "
        "batch. Llama-family and Gemma models, one rank (no tensor parallelism); steps with "
        "adapter tokens run the model's modules (not the native CPU decoder step) and no CUDA "
        "graphs; the prefix cache is keyed by adapter.",
        "engine",
    ),
    Setting(
        "lora_modules",
        str,  # canonical JSON list (parse_lora_modules)
        None,
        "Adapters served from the start, as vLLM's flag: name=path entries (spaces between "
        "them), or JSON objects with name, path and base_model_name (a JSON list of them too). "
        "Each path is a PEFT folder (adapter_config.json and adapter_model.safetensors), "
        "checked when the engine starts. Needs --enable-lora.",
        "engine",
        default_text="none",
        parse=parse_lora_modules,
        nargs="+",
    ),
    Setting(
        "max_loras",
        int,
        1,
        "Adapters one step may use (the device slots of stacked LoRA weights; further "
        "adapters' requests wait for a slot).",
        "engine",
        check=_at_least("max_loras", 1),
    ),
    Setting(
        "max_lora_rank",
        int,
        16,
        "Highest adapter rank (r) accepted; the slots are this wide. One of vLLM's values: "
        "1, 8, 16, 32, 64, 128, 256, 320, 512.",
        "engine",
        check=_check_max_lora_rank,
    ),
    Setting(
        "max_cpu_loras",
        int,
        None,
        "Adapters kept loaded in host memory (LRU; others are read from their folder again "
        "when asked for); at least --max-loras.",
        "engine",
        default_text="--max-loras",
        check=_at_least("max_cpu_loras", 1),
    ),
    # --- engine, CPU kernels: WICK_* variables every command reads (`everywhere`). The first
    # four are per-model decisions: resolved once on rank 0 with the model's config
    # (engine/execution/model_preparation.py) and handed to the platform as values. The last
    # four pick what the native library is and where caches live, process-wide, before anything
    # loads: the entry points export a given flag to its variable at startup (settings_spec
    # `export_process_settings`), which is how the library loader, the caches and spawned
    # tensor-parallel workers all see the same value; that is why they stay variables
    # underneath.
    Setting(
        "cpu_linear_tuning",
        bool,
        None,
        "Time the candidate matmul kernels of every linear weight's shape per row bucket at "
        "startup (timings cached per machine) and run the fastest on each; the native decoder "
        "step needs it. Off: the fixed kernels, nothing timed, --dtype auto decided by the CPU "
        "flags alone; for a quicker first start, or to rule the tuned kernels out.",
        "engine",
        default_text="on",
        env="WICK_CPU_LINEAR_TUNING",
        everywhere=True,
        unset=True,
    ),
    Setting(
        "cpu_linear_tuning_budget",
        float,
        None,
        "Seconds of kernel timing at most per start (all shapes together; shapes left untimed "
        "take the choice of the largest timed bucket, and later starts time the rest). Raise it "
        "for a large model's first start, lower it where startup time matters more.",
        "engine",
        default_text="10",
        env="WICK_CPU_LINEAR_TUNING_BUDGET_S",
        everywhere=True,
        unset=10.0,
        check=_at_least("cpu_linear_tuning_budget", 0.0),
    ),
    Setting(
        "cpu_auto_dtype",
        str,
        None,
        "What --dtype auto does where it would time the dtypes (a CPU with native bf16, or a "
        "bf16 checkpoint on one without): measure (time the model's linear shapes in both "
        "dtypes, cached), or bfloat16 / float32 to pin the choice without timing "
        "(reproducible starts, tests). Elsewhere auto is float32 anyway.",
        "engine",
        default_text="measure",
        env="WICK_CPU_AUTO_DTYPE",
        everywhere=True,
        unset="measure",
        choices=CPU_AUTO_DTYPES,
        parse=parse_cpu_auto_dtype,
    ),
    Setting(
        "gguf_int8_dot",
        str,
        None,
        "Whether GGUF weights kept quantized (--gguf-weights quantized) may run the int8 "
        "dot-product kernel, which rounds activations to int8 per 32 values: auto (where it "
        "times fastest), off (never: the dequantized model's exact products, at some speed), or "
        "on (always, for the block types it takes, untimed: pins the numerics).",
        "engine",
        default_text="auto",
        env="WICK_GGUF_INT8_DOT",
        everywhere=True,
        unset="auto",
        choices=GGUF_INT8_DOT_MODES,
        parse=parse_gguf_int8_dot,
    ),
    Setting(
        "cpu_isa",
        str,
        None,
        "Vector ISA of the native CPU kernels: auto (the best the CPU runs) or a lower path "
        "(avx512, avx2, generic) than the CPU allows, to compare paths or work around one; a "
        "path the CPU cannot run is refused with a warning. Process-wide: exported to its "
        "variable at startup, so tensor-parallel workers build the same library.",
        "engine",
        default_text="auto",
        env="WICK_CPU_ISA",
        everywhere=True,
        unset="auto",
        choices=CPU_ISAS,
        parse=parse_cpu_isa,
    ),
    Setting(
        "cpu_flags",
        str,
        None,
        "Fakes the CPU's flags (space-separated, as /proc/cpuinfo's flags line), which pick the "
        "native kernels' ISA, --dtype auto and the tuning cache's machine key: for tests, and "
        "for reproducing another machine's choices. Process-wide, exported to its variable.",
        "engine",
        default_text="the CPU's own (/proc/cpuinfo)",
        env="WICK_CPU_FLAGS",
        everywhere=True,
    ),
    Setting(
        "cache_dir",
        str,
        None,
        "Wick's cache folder: native kernel builds (kernels/), kernel timings (cpu_tuning/) "
        "and dequantized GGUF copies (gguf/); point it at a persistent volume so restarts "
        "skip the builds and timings. Process-wide, exported to its variable.",
        "engine",
        default_text="~/.cache/wick",
        env="WICK_CACHE_DIR",
        everywhere=True,
    ),
    Setting(
        "gguf_weight_cache",
        bool,
        None,
        "Keep a dequantized safetensors copy of a .gguf model's weights in --cache-dir, so the "
        "next start of the same file loads without decoding the blocks; off saves the disk "
        "space (the copy is the float model's size). Its variable is negated: "
        "WICK_NO_GGUF_CACHE=1 turns it off. Process-wide, exported to its variable.",
        "engine",
        default_text="on",
        env="WICK_NO_GGUF_CACHE",
        everywhere=True,
        unset=True,
        env_negated=True,
    ),
    # --- server: `serve` only
    Setting("host", str, "0.0.0.0", "Address to listen on.", "server"),
    Setting(
        "port",
        int,
        8008,
        "Port to listen on.",
        "server",
        env="LLM_MODEL_SERVER_PORT",
        opea=("LLM_VLLM_PORT",),
        check=_check_port,
    ),
    Setting(
        "served_model_name",
        str,
        None,
        "The model name clients send in requests and see in /v1/models; several names "
        "(--served-model-name a b, or commas: LLM_SERVED_MODEL_NAME=a,b) are aliases, as "
        "vLLM's: the first is the one responses and /metrics report, every one is accepted in "
        "requests, and /v1/models lists each as a card (the first first, all with the same "
        "root).",
        "server",
        default_text=f"--model, or {DEFAULT_MODEL_NAME} for the embedded model",
        parse=parse_served_model_names,
        nargs="+",
    ),
    Setting(
        "accept_any_model_name",
        bool,
        False,
        "Answer a request naming any model with the one served model (its responses still "
        "report the served name; each unknown name is logged once), for clients that hard-code "
        "a name, such as candle-vllm's samples (llama7b, llama, mistral7b). Off: vLLM's 404 "
        "model_not_found for a name that is not one of --served-model-name's.",
        "server",
    ),
    Setting(
        "allow_runtime_lora_updating",
        bool,
        False,
        "Serve vLLM's POST /v1/load_lora_adapter (JSON lora_name and lora_path) and "
        "/v1/unload_lora_adapter (JSON lora_name), which add and remove adapters while the "
        "server runs (with --enable-lora). Off: both answer 404.",
        "server",
        opea=("VLLM_ALLOW_RUNTIME_LORA_UPDATING",),
    ),
    Setting(
        "api_key",
        str,
        None,
        "Require `Authorization: Bearer <key>` on every endpoint except /health, /metrics and "
        "/version.",
        "server",
        default_text="no key",
        secret=True,
    ),
    # CORS (vLLM's flags): off unless --allowed-origins names some, so a server reached from
    # no browser page answers no cross-origin request.
    Setting(
        "allowed_origins",
        str,
        None,
        "Origins whose browser pages may call the API (CORS), e.g. http://localhost:3000 "
        '(several: spaces, commas, or vLLM\'s JSON list \'["http://a", "http://b"]\'); * '
        "allows any. Preflight requests are answered without the API key; every response to an "
        "allowed origin, errors included, carries the CORS headers.",
        "server",
        default_text="none (no CORS headers)",
        parse=parse_list,
        check=_check_allowed_origins,
        nargs="+",
    ),
    Setting(
        "allowed_methods",
        str,
        "*",
        "HTTP methods cross-origin pages may use (with --allowed-origins); * is any.",
        "server",
        parse=parse_list,
        nargs="+",
    ),
    Setting(
        "allowed_headers",
        str,
        "*",
        "Request headers cross-origin pages may send (with --allowed-origins), e.g. "
        "Authorization Content-Type; * is any.",
        "server",
        parse=parse_list,
        nargs="+",
    ),
    Setting(
        "allow_credentials",
        bool,
        False,
        "Let cross-origin pages send cookies and HTTP authentication (with --allowed-origins).",
        "server",
        negatable=False,
    ),
    Setting(
        "skip_warmup",
        bool,
        False,
        "Report ready right after loading, without the warmup requests.",
        "server",
        default_text="warm up",
        opea=("VLLM_SKIP_WARMUP",),
    ),
    Setting(
        "drain_timeout",
        float,
        30.0,
        "Seconds in-flight requests get to finish after SIGTERM/SIGINT; the rest are aborted.",
        "server",
        check=_check_drain_timeout,
    ),
    Setting(
        "max_waiting_requests",
        int,  # None: auto, resolved from --max-num-seqs once the engine config is known
        None,
        "Backpressure: while this many engine requests already wait for the engine (accepted, "
        "not yet running; a /v1/completions request counts one per prompt), a new request gets "
        "503 with Retry-After at once instead of queueing. A request is admitted whole or not at "
        "all, and one with more prompts than this could ever hold gets 400. auto: "
        f"{WAITING_BATCHES} x --max-num-seqs, i.e. {WAITING_BATCHES} full batches queued behind "
        "the running one: enough to refill the batch as its requests finish, few enough that a "
        "queued request starts within a few batches' time rather than after minutes. 0: no "
        "limit.",
        "server",
        default_text=f"auto ({WAITING_BATCHES} x --max-num-seqs: "
        f"{WAITING_BATCHES * _DEFAULT_MAX_NUM_SEQS} at its default)",
        parse=parse_max_waiting_requests,
        check=_non_negative("max_waiting_requests"),
    ),
    # Request limits, checked on the parsed request before any templating or tokenizing
    # (entrypoints/openai/request_limits.py): past one, 400 (413 for the body) naming it.
    Setting(
        "max_request_body_size",
        int,  # bytes
        32 * 1024**2,
        "Largest request body, e.g. 32MiB or 512KiB (a bare number is bytes). A larger one gets "
        "413 without being read whole: at once when its Content-Length says so, else as soon as "
        "a chunked body passes the limit. 32MiB holds a 1M-token prompt several times over, as "
        "text or as token ids, while bounding what one request makes the server parse (JSON of "
        "that size already makes a few hundred MB of Python objects). 0: no limit.",
        "server",
        default_text="32MiB",
        parse=parse_byte_count,
        check=_non_negative("max_request_body_size"),
    ),
    Setting(
        "max_prompts_per_request",
        int,
        256,
        "Most prompts in one /v1/completions request (a list of texts or of token-id lists; each "
        "is an engine request). 256 is one full batch at the default --max-num-seqs: a client "
        "with more sends several requests, which the engine serves no slower. 0: no limit.",
        "server",
        check=_non_negative("max_prompts_per_request"),
    ),
    Setting(
        "max_stop_strings",
        int,
        32,
        "Most stop strings in one request. The engine thread searches the new text of every "
        "sample for each of them after every token; OpenAI takes 4, 32 leaves room for any "
        "client. 0: no limit.",
        "server",
        check=_non_negative("max_stop_strings"),
    ),
    Setting(
        "max_stop_string_length",
        int,
        1024,
        "Longest stop string, in characters. A stream holds back as much text as the longest "
        "stop string could span, and each search looks that far back; 1024 is longer than any "
        "real stop sequence. 0: no limit.",
        "server",
        check=_non_negative("max_stop_string_length"),
    ),
    Setting(
        "max_tools",
        int,
        128,
        "Most tools in one chat request (OpenAI's own limit): every tool's schema goes into the "
        "prompt through the chat template. 0: no limit.",
        "server",
        check=_non_negative("max_tools"),
    ),
    Setting(
        "max_messages",
        int,
        4096,
        "Most messages in one chat or /tokenize request. The chat template renders every one "
        "before the prompt's length is known; 4096 short turns already fill a 128k-token "
        "context. 0: no limit.",
        "server",
        check=_non_negative("max_messages"),
    ),
    Setting(
        "tool_call_parser",
        str,
        "auto",
        "How tool calls are read from the model's output on chat completions with `tools`: "
        "hermes (<tool_call> JSON: Qwen2.5/Qwen3, SmolLM2), llama3_json (Llama 3.1/3.2 JSON), "
        "mistral ([TOOL_CALLS]), or auto (from the chat template; hermes when it says nothing).",
        "server",
        choices=TOOL_CALL_PARSERS,
        check=_check_tool_call_parser,
    ),
    Setting(
        "reasoning_parser",
        str,
        "none",
        "How a reasoning model's thinking is split from its answer on chat completions, as "
        "vLLM's flag: the text between <think> and </think> goes to message.reasoning_content "
        "(and `reasoning`, the same text; delta fields when streaming) instead of content. "
        "qwen3 (Qwen3, QwQ: <think> in the output, or opened by the chat template), "
        "deepseek_r1 (DeepSeek-R1: the output starts inside thinking), auto (from the chat "
        "template: one that writes <think> picks the matching parser, else none), or none (off). "
        "A request with enable_thinking false (top level or in chat_template_kwargs) gets no "
        "reasoning; structured outputs apply after </think>.",
        "server",
        choices=REASONING_PARSERS,
        check=_check_reasoning_parser,
    ),
    # Server-wide sampling defaults (candle-vllm's flags, vLLM's --generation-config): a request
    # field left unset takes the flag, else the model's generation_config.json, else OpenAI's
    # default (entrypoints/openai/sampling_defaults.py).
    Setting(
        "generation_config",
        str,
        "auto",
        "Sampling defaults from a generation_config.json, as vLLM's flag: auto (the model "
        "folder's, when it has one), none (OpenAI's defaults only), or a folder holding one. "
        "Its temperature, top_p, top_k, repetition_penalty and max_new_tokens apply where a "
        "request leaves the field unset; the flags below win over it. The server logs what it "
        "applied at startup.",
        "server",
    ),
    Setting(
        "temperature",
        float,
        None,
        "Default temperature of requests that set none (candle-vllm's flag; 0 is greedy).",
        "server",
        default_text="generation_config's, else 1",
        check=_at_least("temperature", 0.0),
    ),
    Setting(
        "top_p",
        float,
        None,
        "Default top_p of requests that set none, in (0, 1].",
        "server",
        default_text="generation_config's, else 1",
        check=_check_top_p,
    ),
    Setting(
        "top_k",
        int,
        None,
        "Default top_k of requests that set none (0 or -1: off).",
        "server",
        default_text="generation_config's, else off",
        check=_at_least("top_k", -1),
    ),
    Setting(
        "repetition_penalty",
        float,
        None,
        "Default repetition_penalty of requests that set none (candle-vllm's --penalty; 1: "
        "off): a seen token's positive logit is divided by it, a negative one multiplied.",
        "server",
        default_text="generation_config's, else 1",
        aliases=("--penalty",),
        check=_positive("repetition_penalty"),
    ),
    Setting(
        "repeat_last_n",
        int,
        0,
        "The repetition penalty's window (candle-vllm's flag): only the last N tokens of prompt "
        "+ output count as seen. 0: all of them, as vLLM and transformers do.",
        "server",
        default_text="0 (the whole sequence)",
        check=_at_least("repeat_last_n", 0),
    ),
    Setting(
        "max_tokens",
        int,
        None,
        "Default max_tokens of requests that set none (candle-vllm's --max-gen-tokens). "
        "Without it (nor max_new_tokens in generation_config), completions take OpenAI's 16 and "
        "chat completions run to the end of the context.",
        "server",
        default_text="generation_config's max_new_tokens, else 16 / the context",
        aliases=("--max-gen-tokens",),
        check=_at_least("max_tokens", 1),
    ),
    Setting("access_log", bool, True, "Log one line per HTTP request.", "server"),
    Setting(
        "log_level",
        str,
        "info",
        "Logging level (to stderr): debug, info, warning, error.",
        "server",
    ),
)

SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


# The settings that configure the process, not one model: what the native library is built for
# and where caches live. Read from their variables where they are used (the library loader, the
# caches), in every process: so a value given as a flag is exported to the variable at startup
# (`export_process_settings`), before anything loads, and tensor-parallel worker processes
# inherit it.
PROCESS_SETTINGS = ("cpu_isa", "cpu_flags", "cache_dir", "gguf_weight_cache")


def resolve_setting(
    name: str, given: Any = None, environ: MutableMapping[str, str] | None = None
) -> Any:
    """An `everywhere` setting's value: `given` (a flag, an EngineConfig field) unless None,
    else its variable (empty: unset; a bad value is a ValueError naming it), else `unset`."""
    s = SETTINGS_BY_NAME[name]
    if given is not None:
        if s.parse is not None and isinstance(given, str):
            given = s.parse(given)  # the parsers are idempotent, and their errors name `name`
        if s.check is not None:
            s.check(given)
        return given
    text = (os.environ if environ is None else environ).get(s.env_names[0], "").strip()
    return s.from_env_text(text) if text else s.unset


def wick_cache_dir() -> Path:
    """--cache-dir (WICK_CACHE_DIR), else ~/.cache/wick: the native builds, the kernel timings
    and the GGUF copies live under it (kernels/cpu/native.py, tuning_cache.py,
    loader/weight_cache.py)."""
    given = resolve_setting("cache_dir")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "wick"


def export_process_settings(
    source: object, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Write each process setting `source` gives (a non-None attribute: a flag on the command
    line, an EngineConfig field) to its variable, and check the variables of the others (a bad
    one is an error now, not a warning when the library loads). Returns what it wrote."""
    env = os.environ if environ is None else environ
    written: dict[str, str] = {}
    for name in PROCESS_SETTINGS:
        s = SETTINGS_BY_NAME[name]
        value = getattr(source, name, None)
        if value is None:
            resolve_setting(name, environ=env)
            continue
        written[s.env_names[0]] = env[s.env_names[0]] = s.env_text(value)
    return written


def settings_of(group: Group) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.group == group)


def engine_defaults() -> dict[str, Any]:
    """`EngineConfig`'s field defaults: its fields are the engine settings."""
    return {s.name: s.default for s in settings_of("engine")}


# --------------------------------------------------------------------------------------- flags


def add_arguments(parser: argparse.ArgumentParser, group: Group, *, from_environment: bool) -> None:
    """The group's flags on `parser`, in an argument group of that name.

    `from_environment=False`: each flag's argparse default is the setting's default (the
    namespace is complete; `generate`, `worker`, `bench`). `from_environment=True` (`serve`):
    every default is None and help names the variables. No flag stores None when it is given
    (values, store_true and --x/--no-x all store something else), so a None in the namespace
    means "not on the command line": the settings layer drops those and lets the environment,
    then the declared default, fill them in.
    """
    g = parser.add_argument_group(group)
    for s in settings_of(group):
        kwargs: dict[str, Any] = {
            "dest": s.name,
            "default": None if from_environment else s.default,
            "help": s.help_text(env=from_environment),
        }
        if s.default is None and s.default_text is not None:
            # The help says the default; an empty `%(default)` keeps argparse's
            # ArgumentDefaultsHelpFormatter from adding "(default: None)" after it.
            kwargs["help"] += "%(default).0s"
        if s.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if s.negatable else "store_true"
        else:
            if s.parse is not None and from_environment:
                # The settings layer parses the text, as it does a variable's: parsing here too
                # would parse twice (`100B` -> 100 -> read again as a bare number: 100 GiB).
                kwargs["type"] = None
            else:
                kwargs["type"] = s.parse or (s.type if s.type is not str else None)
            if s.choices is not None:
                kwargs["choices"] = list(s.choices)
            if s.nargs is not None:
                kwargs["nargs"] = s.nargs
            if s.check_flag and s.check is not None:
                kwargs["action"] = type(
                    "Checked", (_CheckedAtParse,), {"check": staticmethod(s.check)}
                )
        g.add_argument(s.flag, *s.aliases, **kwargs)


# ---------------------------------------------------------------------------------------- docs


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def configuration_markdown() -> str:
    """docs/configuration.md: every setting with its flag, variables, default and description."""
    opea = [n for s in SETTINGS for n in s.opea]
    out = [
        "# Model server configuration",
        "",
        "<!-- Generated from model_server/settings_spec.py; do not edit. Rewrite it with",
        "     python -m model_server.settings_spec docs/configuration.md -->",
        "",
        "Every setting is a flag of `python -m model_server serve` and an environment variable "
        "(`.env`, compose, the Helm chart's values all use the same `LLM_*` names). "
        "A flag given on the command line wins; otherwise the `LLM_*` variable; otherwise "
        "OPEA's name for it (" + ", ".join(f"`{n}`" for n in opea) + "); otherwise the default. "
        "Empty variables count as unset.",
        "",
        "`generate`, `worker`, `bench throughput`, `bench latency` and `bench structured` take "
        "the engine flags "
        "with the same defaults; they do not read the environment, except the `WICK_*` "
        "variables of the CPU kernel settings (`--cpu-linear-tuning` to `--gguf-weight-cache`), "
        "which every command reads where the flag is not given, as engines built in Python "
        "(`LLM(...)`) do. Of those, `--cpu-linear-tuning`, `--cpu-linear-tuning-budget`, "
        "`--cpu-auto-dtype` and `--gguf-int8-dot` are decided once per model (on rank 0, the "
        "same on every tensor-parallel rank, printed by `wick plan`); "
        + ", ".join(f"`{SETTINGS_BY_NAME[n].flag}`" for n in PROCESS_SETTINGS)
        + " configure the process (which native library loads, where caches live): a flag "
        "given is exported to its variable at startup, before anything loads, so the library "
        "loader and the tensor-parallel worker processes see the same value.",
    ]
    for group in GROUP_COMMANDS:
        commands = ", ".join(f"`{c}`" for c in GROUP_COMMANDS[group])
        out += ["", f"## {group.capitalize()} settings ({commands})", ""]
        out += ["| Flag | Environment | Default | Description |", "|---|---|---|---|"]
        for s in settings_of(group):
            flags = ", ".join(f"`{f}`" for f in (s.flag, *s.aliases))
            if s.type is bool and s.negatable:
                flags += f", `--no-{s.flag[2:]}`"
            env = ", ".join([f"`{s.env_names[0]}`", *(f"`{n}` (OPEA)" for n in s.opea)])
            help_ = s.help + (f" One of: {', '.join(s.choices)}." if s.choices else "")
            out.append(f"| {flags} | {env} | {_cell(s.default_help)} | {_cell(help_)} |")
    out += aliases_markdown()
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python -m model_server.settings_spec [OUTPUT.md]", file=sys.stderr)
        return 2
    text = configuration_markdown()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
