"""Engine steps -> `SchedulerStats` / `IterationStats` for stat loggers (engine thread only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_server.engine.core.scheduler import Scheduler
from model_server.engine.output_processor import RequestOutput, child_request_ids
from model_server.engine.spec_decode.metrics import SpecDecodingStats
from model_server.engine.stats import (
    FinishedRequestStats,
    IterationStats,
    LoRAStats,
    SchedulerStats,
)


@dataclass(slots=True)
class _RequestTimes:
    n: int
    arrival_time: float
    max_tokens: int | None
    num_prompt_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Per sample: time of its latest token (None before its first).
    last_token_times: list[float | None] = field(default_factory=list)
    num_generation_tokens: int = 0


class StatsTracker:
    """Per-request timing kept by the engine thread; never touched by the event loop.

    Counters in `SchedulerStats` are reported relative to `reset_baseline()` (called after
    warmup), so the warmup requests never show up in metrics.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._requests: dict[str, _RequestTimes] = {}
        # Requests not yet seen scheduled (for queue time), a subset of `_requests`.
        self._unscheduled: set[str] = set()
        self._base_preemptions = 0
        self._base_queries = 0
        self._base_hits = 0
        self._base_spec: SpecDecodingStats | None = None

    def reset_baseline(self) -> None:
        s = self._scheduler
        self._base_preemptions = s.num_preemptions_total
        self._base_queries = s.prefix_cache_queries
        self._base_hits = s.prefix_cache_hits
        spec = s.spec_decoding_stats
        self._base_spec = None if spec is None else spec.since(None)

    def scheduler_stats(self) -> SchedulerStats:
        s = self._scheduler
        spec = s.spec_decoding_stats
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_preemptions_total=s.num_preemptions_total - self._base_preemptions,
            prefix_cache_queries=s.prefix_cache_queries - self._base_queries,
            prefix_cache_hits=s.prefix_cache_hits - self._base_hits,
            spec_decoding=None if spec is None else spec.since(self._base_spec),
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        s = self._scheduler
        lora_adapter_names = getattr(s, "lora_adapter_names", None)  # test doubles have none
        names = None if lora_adapter_names is None else lora_adapter_names()
        if names is None or s.config.max_loras is None:
            return None
        return LoRAStats(running=names[0], waiting=names[1], max_lora=s.config.max_loras)

    def num_running(self) -> int:
        return self._scheduler.num_running

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def add(self, request_id: str, n: int, arrival_time: float, max_tokens: int | None) -> None:
        self._requests[request_id] = _RequestTimes(
            n=n, arrival_time=arrival_time, max_tokens=max_tokens, last_token_times=[None] * n
        )
        self._unscheduled.add(request_id)

    def aborted(self, request_id: str, now: float, stats: IterationStats) -> None:
        times = self._requests.pop(request_id, None)
        self._unscheduled.discard(request_id)
        if times is not None:
            stats.finished.append(self._finished(times, "abort", now))

    def update(
        self, outputs: list[RequestOutput], step_start: float, now: float, stats: IterationStats
    ) -> None:
        """Account one step: `step_start` is when it began, `now` when its outputs came out."""
        self._mark_scheduled(step_start)
        for out in outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            if times.first_token_time is None:
                times.first_token_time = now
                times.num_prompt_tokens = len(out.prompt_token_ids)
                stats.num_prompt_tokens += times.num_prompt_tokens
                stats.time_to_first_tokens.append(now - times.arrival_time)
            for sample in out.outputs:
                num_new = len(sample.token_ids_delta)
                if not num_new:
                    continue
                stats.num_generation_tokens += num_new
                times.num_generation_tokens += num_new
                last = times.last_token_times[sample.index]
                if last is not None:
                    stats.inter_token_latencies.append(now - last)
                times.last_token_times[sample.index] = now
            if out.finished:
                del self._requests[out.request_id]
                reason = out.outputs[0].finish_reason or "stop"
                stats.finished.append(self._finished(times, reason, now))

    def _mark_scheduled(self, step_start: float) -> None:
        """A request counts as scheduled once the step that began at `step_start` computed any
        of its tokens (or finished it)."""
        if not self._unscheduled:
            return
        live = self._scheduler.requests
        for request_id in list(self._unscheduled):
            times = self._requests[request_id]
            first_child = child_request_ids(request_id, times.n)[0]
            request = live.get(first_child)
            if request is None or request.num_computed_tokens > 0:
                times.scheduled_time = step_start
                self._unscheduled.discard(request_id)

    @staticmethod
    def _finished(times: _RequestTimes, reason: str, now: float) -> FinishedRequestStats:
        scheduled = times.scheduled_time
        first = times.first_token_time
        prefill = first - scheduled if first is not None and scheduled is not None else 0.0
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - times.arrival_time,
            num_prompt_tokens=times.num_prompt_tokens,
            num_generation_tokens=times.num_generation_tokens,
            queued_time=(scheduled if scheduled is not None else now) - times.arrival_time,
            prefill_time=prefill,
            decode_time=(now - first) if first is not None else 0.0,
            max_tokens_param=times.max_tokens,
            n=times.n,
        )
