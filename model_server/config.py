"""Engine configuration: one dataclass the engine reads; CLI flags and settings build it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from model_server.settings_spec import (
    QUANTIZATION_METHODS,
    check_device_count,
    engine_defaults,
    parse_device_ids,
    parse_quantization,
    parse_size,
)

__all__ = [
    "QUANTIZATION_METHODS",
    "EngineConfig",
    "parse_device_ids",
    "parse_quantization",
    "parse_size",
]

# The defaults are the engine settings' (settings_spec.py), so each is spelled once.
_D: dict[str, Any] = engine_defaults()


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Names mirror `vllm serve` flags. Frozen: the engine
    resolves it once (`EngineCore.config`) and nothing changes it after.

    `max_model_len=None` takes the model's own context length; `kv_cache_memory=None` sizes the
    KV cache on accelerators from a profiled forward: what `gpu_memory_utilization` of the
    device leaves after weights, activations and runtime memory
    (engine/execution/memory_profiler.py); on CPU it is a fixed budget.
    """

    model: str | None = _D["model"]  # None: the embedded SmolLM2 GGUF
    load_format: str = _D["load_format"]  # auto | dummy
    dtype: str = _D["dtype"]  # auto | float32 | bfloat16 | float16
    quantization: str | None = _D["quantization"]  # None | int8 (layers/quantization/)
    gguf_weights: str = _D["gguf_weights"]  # auto | quantized | dequantized (GGUF files)
    # auto | bfloat16 | float16 | int8 | fp8_e4m3 | fp8_e5m2 (kernels/kv_cache_dtype.py)
    kv_cache_dtype: str = _D["kv_cache_dtype"]
    device: str = _D["device"]  # cpu | cuda | gcu | hpu | auto
    device_ids: list[int] | None = _D["device_ids"]  # rank i uses device_ids[i]; None: 0, 1, ...
    tensor_parallel_size: int = _D["tensor_parallel_size"]
    seed: int = _D["seed"]
    hf_overrides: str | None = _D["hf_overrides"]  # JSON object of HF config fields
    max_model_len: int | None = _D["max_model_len"]
    max_num_seqs: int = _D["max_num_seqs"]
    # None: the platform's default (Platform.default_max_num_batched_tokens), set by EngineCore.
    max_num_batched_tokens: int | None = _D["max_num_batched_tokens"]
    block_size: int = _D["block_size"]
    kv_cache_memory: int | None = _D["kv_cache_memory"]  # bytes
    enable_prefix_caching: bool = _D["enable_prefix_caching"]
    enable_chunked_prefill: bool = _D["enable_chunked_prefill"]
    attention_backend: str | None = _D["attention_backend"]  # None: the platform's default
    enforce_eager: bool = _D["enforce_eager"]
    gpu_memory_utilization: float = _D["gpu_memory_utilization"]
    num_threads: int | None = _D["num_threads"]

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
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        check_device_count(self.device_ids, self.tensor_parallel_size)
        parse_quantization(self.quantization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
