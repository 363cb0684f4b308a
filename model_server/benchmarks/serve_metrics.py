"""Figures of a serving benchmark from its per-request results, and vLLM's report layout.

Statistics are numpy's: mean, median, population std, and `np.percentile` with linear
interpolation, over successful requests only (failed ones count in `failed`). TPOT per request
is `(E2EL − TTFT) / (output_tokens − 1)`, defined for requests with more than one output token.
Every latency figure is reported in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_server.benchmarks.openai_stream import RequestResult

LATENCY_METRICS: tuple[tuple[str, str, str], ...] = (
    # (key, label, section header)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass(slots=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: list[tuple[float, float]]  # (percentile, value)


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    latencies: dict[str, LatencyStats] = field(default_factory=dict)


def latency_stats(values_s: list[float], percentiles: list[float]) -> LatencyStats:
    """Statistics of `values_s` (seconds) in milliseconds; all zero for an empty list."""
    import numpy as np

    arr = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    return LatencyStats(
        mean_ms=float(np.mean(arr)),
        median_ms=float(np.median(arr)),
        std_ms=float(np.std(arr)),
        percentiles_ms=[(p, float(np.percentile(arr, p))) for p in percentiles],
    )


def calculate_metrics(
    results: list[RequestResult], duration_s: float, percentiles: list[float]
) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    series: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        latencies={k: latency_stats(v, percentiles) for k, v in series.items()},
    )


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_report(
    m: BenchmarkMetrics,
    *,
    max_concurrency: int | None = None,
    request_rate: float | None = None,
    prefix_cache_hit_rate: float | None = None,
) -> str:
    """The result block, laid out like vLLM's `benchmark_serving` / `vllm bench serve`, plus the
    server's prefix-cache hit rate over the run when it exports one (benchmarks/prefix_hits.py)."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: float | int) -> None:
        fmt = "{:<40} {:<10}" if isinstance(value, int) else "{:<40} {:<10.2f}"
        lines.append(fmt.format(label, value))

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate is not None and request_rate != float("inf"):
        row("Request rate configured (RPS):", float(request_rate))
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    if prefix_cache_hit_rate is not None:
        row("Server prefix cache hit rate (%):", 100.0 * prefix_cache_hit_rate)
    for key, label, header in LATENCY_METRICS:
        stats = m.latencies[key]
        lines.append(f"{header:-^50}")
        row(f"Mean {label} (ms):", stats.mean_ms)
        row(f"Median {label} (ms):", stats.median_ms)
        for p, value in stats.percentiles_ms:
            row(f"P{_percentile_word(p)} {label} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(m: BenchmarkMetrics, results: list[RequestResult], **info: Any) -> dict[str, Any]:
    """All figures (vLLM's `--save-result` key names) plus per-request lists and `info`."""
    out: dict[str, Any] = dict(info)
    out.update(
        duration=m.duration_s,
        completed=m.completed,
        failed=m.failed,
        total_input_tokens=m.total_input,
        total_output_tokens=m.total_output,
        request_throughput=m.request_throughput,
        output_throughput=m.output_throughput,
        total_token_throughput=m.total_token_throughput,
    )
    for key, _, _ in LATENCY_METRICS:
        stats = m.latencies[key]
        out[f"mean_{key}_ms"] = stats.mean_ms
        out[f"median_{key}_ms"] = stats.median_ms
        out[f"std_{key}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            out[f"p{_percentile_word(p)}_{key}_ms"] = value
    out.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens if r.success else 0 for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        e2els=[r.latency for r in results],
        errors=[r.error for r in results],
    )
    return out
