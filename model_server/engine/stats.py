"""Engine statistics handed to stat loggers (Prometheus metrics, logs) after every engine step.

The async engine builds one `SchedulerStats` and one `IterationStats` per step, in its engine
thread, and calls `StatLogger.record(scheduler_stats, iteration_stats)` on each registered logger.
Loggers must be quick and thread-safe (they run on the engine thread, while the HTTP layer may
read them concurrently); they must never raise (an exception is logged and ignored).

Names follow vLLM v1's `vllm/v1/metrics/stats.py`. Times are seconds (monotonic differences).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from model_server.engine.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True, frozen=True)
class LoRAStats:
    """vLLM's `vllm:lora_requests_info` labels: the adapters' names of the running and the
    waiting requests (each once, first seen first) and --max-loras."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the scheduler after a step (gauges, and counters as running totals)."""

    num_running: int = 0
    num_waiting: int = 0
    # Fraction of KV cache blocks in use, in [0, 1].
    kv_cache_usage: float = 0.0
    # Running totals since start (monotonic: loggers turn them into counter increments).
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Speculative decoding's running totals (None: speculation off).
    spec_decoding: SpecDecodingStats | None = None
    # LoRA adapters of the running and waiting requests (None: --enable-lora off).
    lora: LoRAStats | None = None


@dataclass(slots=True, frozen=True)
class CacheConfigInfo:
    """The KV cache as sized at startup (vLLM's `vllm:cache_config_info` labels)."""

    block_size: int
    num_gpu_blocks: int  # blocks of the (full-attention) pool, vLLM's name on every device
    cache_dtype: str  # resolved --kv-cache-dtype: float32 | bfloat16 | float16 | int8 | fp8_*
    kv_cache_bytes: int  # per rank, every layer's cache with its scales
    enable_prefix_caching: bool


@dataclass(slots=True)
class FinishedRequestStats:
    """One request (all its samples) that finished, aborted requests included."""

    # "stop" | "length" | "abort"
    finish_reason: str
    # Arrival in the engine -> last output.
    e2e_latency: float
    num_prompt_tokens: int
    # Summed over the request's n samples.
    num_generation_tokens: int
    # Arrival -> first scheduled (waiting in the queue).
    queued_time: float = 0.0
    # First scheduled -> first token.
    prefill_time: float = 0.0
    # First token -> last token.
    decode_time: float = 0.0
    # Requested max_tokens (None: up to the context length).
    max_tokens_param: int | None = None
    n: int = 1


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step. Counts are increments for this step only."""

    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token this step
    num_generation_tokens: int = 0  # tokens generated this step, all requests
    # One entry per request (per sample for n > 1) that produced its first token this step.
    time_to_first_tokens: list[float] = field(default_factory=list)
    # One entry per token that was not a request's first: the gap since its previous token.
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@runtime_checkable
class StatLogger(Protocol):
    """Receives the stats of every engine step (called on the engine thread)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


def record_cache_config(loggers: list, info: CacheConfigInfo) -> None:
    """Once the engine has sized its KV cache: hand `info` to the loggers that take it
    (`record_cache_config(info)`, optional for a StatLogger)."""
    for stat_logger in loggers:
        record = getattr(stat_logger, "record_cache_config", None)
        if record is not None:
            record(info)
