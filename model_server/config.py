"""Engine configuration: one dataclass the engine reads; CLI flags and settings build it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from model_server.settings_spec import (
    QUANTIZATION_METHODS,
    check_device_count,
    engine_defaults,
    parse_device_ids,
    parse_kv_events_config,
    parse_lora_modules,
    parse_quantization,
    parse_size,
    parse_speculative_config,
    resolve_setting,
)

__all__ = [
    "QUANTIZATION_METHODS",
    "EngineConfig",
    "KVEventsConfig",
    "KernelOptions",
    "SpeculativeConfig",
    "parse_device_ids",
    "parse_quantization",
    "parse_size",
]

# The defaults are the engine settings' (settings_spec.py), so each is spelled once.
_D: dict[str, Any] = engine_defaults()


@dataclass(slots=True, frozen=True)
class KernelOptions:
    """The kernels' per-model settings as decided (no None: flag, else WICK_* variable, else the
    declared value). Made once per engine, on rank 0, and handed to the platform's
    `kernel_table`, `resolve_dtype`, `plan_linears` and `native_decoder_step` as a value."""

    linear_tuning: bool  # --cpu-linear-tuning: time the matmuls, plan each weight's kernels
    tuning_budget_s: float  # --cpu-linear-tuning-budget
    auto_dtype: str  # --cpu-auto-dtype: measure | bfloat16 | float32
    gguf_int8_dot: str  # --gguf-int8-dot: auto | on | off

    @classmethod
    def resolve(cls, source: object | None = None) -> KernelOptions:
        """From `source`'s fields (an EngineConfig; None ones and a missing `source`: the
        variables, as tests and tools that call the platform directly set them)."""

        def value(name: str) -> Any:
            return resolve_setting(name, getattr(source, name, None))

        return cls(
            linear_tuning=bool(value("cpu_linear_tuning")),
            tuning_budget_s=float(value("cpu_linear_tuning_budget")),
            auto_dtype=value("cpu_auto_dtype"),
            gguf_int8_dot=value("gguf_int8_dot"),
        )

    def describe(self) -> str:
        tuning = f"on, {self.tuning_budget_s:g}s budget" if self.linear_tuning else "off"
        return (
            f"cpu linear tuning {tuning}; cpu auto dtype {self.auto_dtype}; "
            f"gguf int8 dot {self.gguf_int8_dot}"
        )


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, when events are published (`--kv-events-config`)."""

    endpoint: str
    replay_endpoint: str | None
    buffer_steps: int
    hwm: int
    max_queue_size: int
    topic: str

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """None when events are off (no config, disabled, or the null publisher)."""
        values = parse_kv_events_config(text)
        if values is None:
            return None
        return cls(**{f.name: values[f.name] for f in fields(cls)})


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's SpeculativeConfig (`--speculative-config`): n-gram prompt lookup, or a draft
    model (engine/execution/draft_model.py)."""

    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int  # k: drafts verified per step and request
    prompt_lookup_min: int  # the shortest suffix n-gram matched (ngram)
    prompt_lookup_max: int  # the longest (ngram)
    disable_by_batch_size: int  # speculate only while fewer requests than this run
    model: str | None = None  # the draft model's path or hub id (draft_model); None: ngram

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """None when speculation is off; ValueError naming the key for anything unsupported."""
        values = parse_speculative_config(text)
        if values is None:
            return None
        return cls(**{f.name: values[f.name] for f in fields(cls)})


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
    # vLLM's static per-layer KV scales (JSON), for a quantized kv_cache_dtype; None: per row.
    quantization_param_path: str | None = _D["quantization_param_path"]
    device: str = _D["device"]  # cpu | cuda | gcu | hpu | auto
    device_ids: list[int] | None = _D["device_ids"]  # rank i uses device_ids[i]; None: 0, 1, ...
    tensor_parallel_size: int = _D["tensor_parallel_size"]
    distributed_executor_backend: str = _D["distributed_executor_backend"]  # mp | ray
    seed: int = _D["seed"]
    hf_overrides: str | None = _D["hf_overrides"]  # JSON object of HF config fields
    max_model_len: int | None = _D["max_model_len"]
    max_num_seqs: int = _D["max_num_seqs"]
    # None: the platform's default (Platform.default_max_num_batched_tokens), set by EngineCore.
    max_num_batched_tokens: int | None = _D["max_num_batched_tokens"]
    block_size: int = _D["block_size"]
    kv_cache_memory: int | None = _D["kv_cache_memory"]  # bytes
    enable_prefix_caching: bool = _D["enable_prefix_caching"]
    kv_events_config: str | None = _D["kv_events_config"]  # JSON: vLLM's KVEventsConfig
    speculative_config: str | None = _D["speculative_config"]  # JSON: vLLM's SpeculativeConfig
    enable_chunked_prefill: bool = _D["enable_chunked_prefill"]
    attention_backend: str | None = _D["attention_backend"]  # None: the platform's default
    enforce_eager: bool = _D["enforce_eager"]
    gpu_memory_utilization: float = _D["gpu_memory_utilization"]
    num_threads: int | None = _D["num_threads"]
    # LoRA adapters (model_server/lora/): off unless enable_lora. lora_modules is the canonical
    # JSON list of settings_spec.parse_lora_modules; max_cpu_loras None: max_loras.
    enable_lora: bool = _D["enable_lora"]
    lora_modules: str | None = _D["lora_modules"]
    max_loras: int = _D["max_loras"]
    max_lora_rank: int = _D["max_lora_rank"]
    max_cpu_loras: int | None = _D["max_cpu_loras"]
    # The CPU kernels' settings: None is "not given": the WICK_* variable decides, else the
    # declared value (settings_spec.resolve_setting). The per-model ones reach the platform as
    # `KernelOptions`; the process ones are exported to their variables (export_process_settings).
    cpu_linear_tuning: bool | None = _D["cpu_linear_tuning"]
    cpu_linear_tuning_budget: float | None = _D["cpu_linear_tuning_budget"]  # seconds
    cpu_auto_dtype: str | None = _D["cpu_auto_dtype"]  # measure | bfloat16 | float32
    gguf_int8_dot: str | None = _D["gguf_int8_dot"]  # auto | on | off
    cpu_isa: str | None = _D["cpu_isa"]  # auto | avx512_bf16 | avx512 | avx2 | generic
    cpu_flags: str | None = _D["cpu_flags"]  # fake /proc/cpuinfo flags, space-separated
    cache_dir: str | None = _D["cache_dir"]
    gguf_weight_cache: bool | None = _D["gguf_weight_cache"]

    def kernel_options(self) -> KernelOptions:
        """The per-model kernel settings, each unset one from its variable (resolved once, on
        rank 0, by the model-preparation stage)."""
        return KernelOptions.resolve(self)

    @classmethod
    def from_attrs(cls, source: object) -> EngineConfig:
        """The config from any object with an attribute per field (parsed CLI flags,
        `ServerSettings`); `device_ids` may still be the raw "0,1" text. A missing attribute is
        an error, so a new field cannot be silently left at its default by one entry point."""
        values = {f.name: getattr(source, f.name) for f in fields(cls)}
        values["device_ids"] = parse_device_ids(values["device_ids"])
        values["lora_modules"] = parse_lora_modules(values["lora_modules"])
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
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray, got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "ray" and self.tensor_parallel_size < 2:
            raise ValueError(
                "--distributed-executor-backend ray starts tensor-parallel ranks as Ray actors: "
                "it needs --tensor-parallel-size 2 or more"
            )
        parse_quantization(self.quantization)
        if KVEventsConfig.parse(self.kv_events_config) and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-events-config publishes the prefix cache's blocks: it needs prefix "
                "caching (drop --no-enable-prefix-caching)"
            )
        if SpeculativeConfig.parse(self.speculative_config) and self.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config is not supported with tensor parallelism yet "
                "(the ranks' LM-head collectives would need the verification rows, and a "
                "draft model runs on one rank)"
            )
        self.kernel_options()  # a bad kernel setting or WICK_* variable: one error, before loading
        self._validate_lora()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _validate_lora(self) -> None:
        """The LoRA flags: refused where they would be ignored or cannot be honoured."""
        if not self.enable_lora:
            if self.lora_modules is not None:
                raise ValueError("--lora-modules needs --enable-lora")
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "--enable-lora runs on one rank for now: drop --tensor-parallel-size "
                f"{self.tensor_parallel_size}"
            )
        if KVEventsConfig.parse(self.kv_events_config):
            raise ValueError(
                "--kv-events-config with --enable-lora is not supported yet: the events' block "
                "hashes would not say which adapter computed a block"
            )
