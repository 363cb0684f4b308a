"""`bench soak`: its arithmetic, and a short real soak through the microservice in front of the
real model server (every kind of request, the figures printed, nothing lost, KV back to 0)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_server.benchmarks.soak import metric_sum, percentile
from tests.e2e.conftest import ServerProcess, launch
from tests.e2e.test_microservice import Microservice, start_microservice

ROOT = Path(__file__).parents[2]


def test_percentile_interpolates_like_numpy() -> None:
    import numpy as np

    values = [0.3, 1.0, 0.2, 5.0, 2.5]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) == 0.0


def test_metric_sum_adds_every_series() -> None:
    text = (
        "# HELP x y\n"
        'llm_microservice_requests_total{status="200"} 7.0\n'
        'llm_microservice_requests_total{status="400"} 2.0\n'
        "process_resident_memory_bytes 1.5e+08\n"
    )
    assert metric_sum(text, "llm_microservice_requests_total") == 9.0
    assert metric_sum(text, "process_resident_memory_bytes") == 1.5e8
    assert metric_sum(text, "vllm:kv_cache_usage_perc") is None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Microservice]]:
    log_dir = tmp_path_factory.mktemp("soak")
    server = launch(log_dir)
    usvc = None
    try:
        server.wait_ready()
        usvc = start_microservice(log_dir, server.url, "generic")
        usvc.wait_up()
        yield server, usvc
    finally:
        if usvc is not None:
            usvc.stop()
        server.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_soak_reports_everything_and_loses_nothing(
    stack: tuple[ServerProcess, Microservice],
) -> None:
    server, usvc = stack
    cmd = [
        sys.executable, "-m", "model_server", "bench", "soak",
        "--base-url", usvc.url, "--model-server-url", server.url,
        "--duration-minutes", "0.5", "--report-every-s", "10", "--concurrency", "3",
        "--max-tokens", "8", "--cancel-fraction", "0.3", "--bad-fraction", "0.2",
        "--hostile-fraction", "0.2", "--max-rss-growth-mib", "300",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "[start] RSS" in out and out.count(" min] ok ") >= 3  # every 10 s, and the end
    summary = next(line for line in out.splitlines() if line.startswith("  ok "))
    counts = dict(
        (part.rsplit(" ", 1)[0].strip(), int(part.rsplit(" ", 1)[1]))
        for part in summary.strip().split(", ")
    )
    assert counts["failed"] == 0 and counts["lost"] == 0
    # Answered, and malformed requests refused (a loaded machine may see few of each kind).
    assert counts["ok"] + counts["cancelled"] > 0 and counts["bad->4xx"] > 0
    # Hostile requests (some sent to the model server itself, which the microservice never
    # counts: not "lost") all answered 4xx.
    assert counts["hostile->4xx"] > 0 and "hostile requests answered in: p50" in out
    assert "KV cache at the end: 0.0" in out
    assert "latency of answered requests: p50" in out and "model server RSS: start" in out
