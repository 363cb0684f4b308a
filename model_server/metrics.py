"""Prometheus metrics of the model server, with vLLM's names so its dashboards and rules work.

`EngineMetrics` is a `StatLogger` (see `engine/stats.py`): the async engine calls `record()` on
its engine thread after every step. Every instance owns its own `CollectorRegistry`, so tests
(and several servers in one process) never collide on the global registry.
`mount_metrics(app)` adds `GET /metrics` (Prometheus text format) to a FastAPI/Starlette app.

Names and buckets follow vLLM v1's `PrometheusStatLogger`. prometheus-client appends `_total`
to counter names in the exposition, so `vllm:prompt_tokens` is scraped as
`vllm:prompt_tokens_total`, as in vLLM.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from model_server.engine.spec_decode.metrics import SpecDecodingStats
    from model_server.engine.stats import (
        CacheConfigInfo,
        IterationStats,
        LoRAStats,
        SchedulerStats,
    )

logger = logging.getLogger(__name__)

# vLLM's bucket boundaries (seconds).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
REQUEST_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)

# Finish reasons whose `vllm:request_success_total` series exist from the start (at 0), like
# vLLM, so `rate()` works before the first request of each kind. Others are added on first use.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, … up to and including `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class EngineMetrics:
    """Prometheus metrics fed by the engine's per-step stats (a `StatLogger`).

    Thread-safety: `record()` runs on the engine thread while `/metrics` renders on the event
    loop; prometheus-client's metric objects are thread-safe, and the only state of our own
    (the last cumulative totals) is guarded by a lock.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 8192,
        *,
        registry: CollectorRegistry | None = None,
        include_process_metrics: bool = True,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        if include_process_metrics:
            _register_process_collectors(self.registry)
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(model_name)

        # What is served: 1 on the series of the weights' quantization ("none" for float).
        self.model_info = Gauge(
            "wick:model_info",
            "The served model; the quantization label is the weights' format "
            "(e.g. 'gptq w4 g128', 'awq w4 g128', 'int8', 'none').",
            ["model_name", "quantization"],
            registry=reg,
        )
        # Scheduler state.
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # vLLM < 0.10's name, still used by many dashboards and autoscaling rules.
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: use vllm:kv_cache_usage_perc instead.",
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        # Speculative decoding (--speculative-config): a draft is one request's drafts verified
        # in one step; mean acceptance length = 1 + accepted tokens / drafts.
        self.spec_decode_num_drafts = counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["model_name", "position"],
            registry=reg,
        )

        # HTTP answers, by route: prometheus-fastapi-instrumentator's name (as vLLM's server
        # exposes), with exact statuses so that 503s (backpressure, draining) stand out.
        self.http_requests = Counter(
            "http_requests",
            "HTTP requests answered, by route, method and status.",
            ["handler", "method", "status"],
            registry=reg,
        )

        # Token counters.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)

        # Per-request token counts.
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.request_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS
        )

        # Latencies.
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        # vLLM's older name for the same observations (one per non-first token).
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: use vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # The KV cache as sized at startup: one series of value 1 whose labels say it (vLLM's).
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            ["block_size", "cache_dtype", "num_gpu_blocks", "kv_cache_bytes",
             "enable_prefix_caching"],
            registry=reg,
        )  # fmt: skip

        # vLLM's LoRA gauge (--enable-lora): one series whose labels name the adapters of the
        # running and the waiting requests, valued the time it was set (vLLM's
        # set_to_current_time). Only the latest label set is kept (vLLM keeps every one seen):
        # adapter names come and go, and the series must stay bounded.
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        self._last_lora_labels: tuple[str, str, str] | None = None

        # Last seen running totals of SchedulerStats (turned into counter increments).
        self._lock = threading.Lock()
        self._last_preemptions = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])

    # -- StatLogger -------------------------------------------------------------------------

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
    ) -> None:
        """Update the metrics from one engine step. Never raises (a bad stat is logged)."""
        try:
            if scheduler_stats is not None:
                self._record_scheduler(scheduler_stats)
            if iteration_stats is not None:
                self._record_iteration(iteration_stats)
        except Exception:  # a metrics bug must never take the engine loop down
            logger.exception("failed to record engine stats")

    def record_cache_config(self, info: CacheConfigInfo) -> None:
        """Once, when the engine has sized its KV cache (engine/stats.record_cache_config)."""
        self.cache_config_info.labels(
            block_size=str(info.block_size),
            cache_dtype=info.cache_dtype,
            num_gpu_blocks=str(info.num_gpu_blocks),
            kv_cache_bytes=str(info.kv_cache_bytes),
            enable_prefix_caching=str(info.enable_prefix_caching),
        ).set(1)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        with self._lock:
            d_preempt = _delta(stats.num_preemptions_total, self._last_preemptions)
            d_queries = _delta(stats.prefix_cache_queries, self._last_prefix_queries)
            d_hits = _delta(stats.prefix_cache_hits, self._last_prefix_hits)
            self._last_preemptions = stats.num_preemptions_total
            self._last_prefix_queries = stats.prefix_cache_queries
            self._last_prefix_hits = stats.prefix_cache_hits
        if d_preempt:
            self.num_preemptions.inc(d_preempt)
        if d_queries:
            self.prefix_cache_queries.inc(d_queries)
        if d_hits:
            self.prefix_cache_hits.inc(d_hits)
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding)
        if stats.lora is not None:
            self._record_lora(stats.lora)

    def _record_lora(self, lora: LoRAStats) -> None:
        labels = (str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running))
        with self._lock:
            last, self._last_lora_labels = self._last_lora_labels, labels
        if last is not None and last != labels:
            self.lora_requests_info.remove(*last)
        self.lora_requests_info.labels(*labels).set_to_current_time()

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        totals = (
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            spec.num_accepted_tokens_per_pos,
        )
        with self._lock:
            last = self._last_spec
            self._last_spec = (totals[0], totals[1], totals[2], list(totals[3]))
        counters = (
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
        )
        for counter, total, previous in zip(counters, totals[:3], last[:3], strict=True):
            if d := _delta(total, previous):
                counter.inc(d)
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for pos, total in enumerate(totals[3]):
            previous = last[3][pos] if pos < len(last[3]) else 0
            if d := _delta(total, previous):
                per_pos.labels(self.model_name, str(pos)).inc(d)

    def _record_iteration(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
            self.time_per_output_token.observe(itl)
        for req in stats.finished:
            self._request_success.labels(self.model_name, req.finish_reason).inc()
            self.e2e_request_latency.observe(req.e2e_latency)
            self.request_queue_time.observe(req.queued_time)
            self.request_prefill_time.observe(req.prefill_time)
            self.request_decode_time.observe(req.decode_time)
            self.request_inference_time.observe(req.prefill_time + req.decode_time)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)
            self.request_n.observe(req.n)
            if req.max_tokens_param:
                self.request_max_tokens.observe(req.max_tokens_param)

    def set_model_info(self, quantization: str | None) -> None:
        """Called once the model is loaded (async_engine.py)."""
        self.model_info.clear()
        self.model_info.labels(self.model_name, quantization or "none").set(1)

    def count_http(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()

    # -- exposition -------------------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry as `(body, content_type)`, in the format the scraper's `Accept` header
        asks for (OpenMetrics or the Prometheus text format); text 0.0.4 when it asks nothing."""
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.openmetrics import exposition as openmetrics

        encoder, content_type = choose_encoder(accept or "")
        if content_type.startswith("application/openmetrics-text"):
            # prometheus-client's default OpenMetrics escaping ("underscores") turns the ':' of
            # vLLM's names into '_' in the samples (not in HELP/TYPE), although ':' is valid in
            # every Prometheus name: a real Prometheus (which asks for OpenMetrics) stored
            # vllm_num_requests_running, and dashboards querying vllm:* found nothing. Our
            # names are all classic Prometheus names, so they need no escaping.
            content_type = content_type.split("; escaping=")[0]
            return openmetrics.generate_latest(self.registry, escaping=openmetrics.ALLOWUTF8), (
                content_type
            )
        return encoder(self.registry), content_type


def _delta(total: int, last: int) -> int:
    """Increment for a counter fed by a running total. A total that went down means the
    engine restarted its count: everything since is new."""
    return total - last if total >= last else total


def _register_process_collectors(registry: CollectorRegistry) -> None:
    """process_* (CPU, memory, fds), python_gc_* and python_info, as on the global registry."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


def mount_metrics(app: Any, metrics: EngineMetrics | None = None, path: str = "/metrics") -> None:
    """Add `GET {path}` to a FastAPI/Starlette `app`, serving Prometheus text.

    With `metrics=None` the route reads `app.state.metrics` at each scrape, so the app factory
    can mount the route before the engine (and its metrics) exist. Until then it answers an
    empty exposition (200), so scrapers and probes never see an error during startup.
    """
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
    from starlette.responses import Response

    async def metrics_endpoint(request: Any) -> Response:
        source = metrics if metrics is not None else getattr(request.app.state, "metrics", None)
        if source is None:
            return Response(content=b"", headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
        body, content_type = source.render(request.headers.get("accept"))
        # `headers`, not `media_type`: the content type already carries its charset.
        return Response(content=body, headers={"Content-Type": content_type})

    app.add_route(path, metrics_endpoint, methods=["GET"], include_in_schema=False)
