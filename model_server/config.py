"""Engine configuration: one dataclass the engine reads; CLI flags and settings build it."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

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
    """Parse a memory size like `2GiB`, `512MiB`, `1.5GB` or a plain byte count.

    A bare number up to 4096 is read as GiB, like vLLM's `VLLM_CPU_KVCACHE_SPACE=4`.
    """
    if isinstance(text, (int, float)):
        value = float(text)
        return int(value * 1024**3) if value <= 4096 else int(value)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse memory size {text!r}: use e.g. 2GiB, 512MiB or 1.5GB")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and number <= 4096:
        return int(number * 1024**3)
    return int(number * _SIZE_UNITS[unit])


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


QUANTIZATION_METHODS = ("int8",)
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
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {value!r} is not supported; choose one of: "
            f"{', '.join(QUANTIZATION_METHODS)} (or none)"
        )
    return method


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Names mirror `vllm serve` flags.

    `max_model_len=None` takes the model's own context length; `kv_cache_memory=None` sizes the
    KV cache on accelerators from a profiled forward: what `gpu_memory_utilization` of the
    device leaves after weights, activations and runtime memory (engine/memory_profiler.py); on
    CPU it is a fixed budget.
    """

    model: str | None = None  # None: the embedded SmolLM2 GGUF
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str | None = None  # None | int8 (weight-only, in situ; layers/quantization.py)
    device: str = "cpu"  # cpu | cuda | gcu | hpu | auto
    device_ids: list[int] | None = None  # local rank i uses device_ids[i]; None: 0, 1, ...
    tensor_parallel_size: int = 1
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str | None = None  # None: the platform's default
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    num_threads: int | None = None

    @classmethod
    def from_attrs(cls, source: object) -> EngineConfig:
        """The config from any object with an attribute per field (parsed CLI flags,
        `ServerSettings`); `device_ids` may still be the raw "0,1" text. A missing attribute is
        an error, so a new field cannot be silently left at its default by one entry point."""
        values = {f.name: getattr(source, f.name) for f in fields(cls)}
        values["device_ids"] = parse_device_ids(values["device_ids"])
        return cls(**values)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        parse_quantization(self.quantization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
