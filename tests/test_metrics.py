"""EngineMetrics: stats in, exact Prometheus samples out; the exposition passes promtool."""

from __future__ import annotations

import pytest

from model_server.engine.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    StatLogger,
)
from model_server.metrics import (
    EngineMetrics,
    build_1_2_5_buckets,
    mount_metrics,
)
from tests.promtool import promtool_check_metrics

MODEL = "smol"
L = {"model_name": MODEL}


def _value(m: EngineMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**L, **labels})


def _finished(**kw) -> FinishedRequestStats:
    base = dict(
        finish_reason="stop",
        e2e_latency=1.2,
        num_prompt_tokens=7,
        num_generation_tokens=5,
        queued_time=0.1,
        prefill_time=0.2,
        decode_time=0.9,
        max_tokens_param=16,
        n=1,
    )
    base.update(kw)
    return FinishedRequestStats(**base)


def _feed(m: EngineMetrics) -> None:
    m.record(
        SchedulerStats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.25,
            num_preemptions_total=1,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
        ),
        IterationStats(
            num_prompt_tokens=12,
            num_generation_tokens=3,
            time_to_first_tokens=[0.05, 0.3],
            inter_token_latencies=[0.02],
        ),
    )
    m.record(
        SchedulerStats(
            num_running=1,
            num_waiting=0,
            kv_cache_usage=0.5,
            num_preemptions_total=3,
            prefix_cache_queries=150,
            prefix_cache_hits=40,
        ),
        IterationStats(
            num_prompt_tokens=0,
            num_generation_tokens=2,
            inter_token_latencies=[0.03, 0.2],
            finished=[_finished(), _finished(finish_reason="length", e2e_latency=3.0)],
        ),
    )


def test_is_a_stat_logger() -> None:
    assert isinstance(EngineMetrics(MODEL, include_process_metrics=False), StatLogger)


def test_gauges_are_the_last_snapshot() -> None:
    m = EngineMetrics(MODEL)
    _feed(m)
    assert _value(m, "vllm:num_requests_running") == 1
    assert _value(m, "vllm:num_requests_waiting") == 0
    assert _value(m, "vllm:kv_cache_usage_perc") == 0.5
    assert _value(m, "vllm:gpu_cache_usage_perc") == 0.5


def test_counters_from_running_totals_are_increments() -> None:
    m = EngineMetrics(MODEL)
    _feed(m)
    assert _value(m, "vllm:num_preemptions_total") == 3
    assert _value(m, "vllm:prefix_cache_queries_total") == 150
    assert _value(m, "vllm:prefix_cache_hits_total") == 40
    # The same totals again add nothing.
    m.record(SchedulerStats(0, 0, 0.0, 3, 150, 40), None)
    assert _value(m, "vllm:num_preemptions_total") == 3
    assert _value(m, "vllm:prefix_cache_queries_total") == 150
    # A total that went down (engine restarted its count) counts as all new.
    m.record(SchedulerStats(0, 0, 0.0, 2, 150, 40), None)
    assert _value(m, "vllm:num_preemptions_total") == 5


def test_token_counters_and_request_success() -> None:
    m = EngineMetrics(MODEL)
    _feed(m)
    assert _value(m, "vllm:prompt_tokens_total") == 12
    assert _value(m, "vllm:generation_tokens_total") == 5
    assert _value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert _value(m, "vllm:request_success_total", finished_reason="length") == 1
    # Pre-created at zero, like vLLM.
    assert _value(m, "vllm:request_success_total", finished_reason="abort") == 0


def test_latency_histograms() -> None:
    m = EngineMetrics(MODEL)
    _feed(m)
    ttft = "vllm:time_to_first_token_seconds"
    assert _value(m, ttft + "_count") == 2
    assert _value(m, ttft + "_sum") == pytest.approx(0.35)
    assert _value(m, ttft + "_bucket", le="0.04") == 0
    assert _value(m, ttft + "_bucket", le="0.06") == 1
    assert _value(m, ttft + "_bucket", le="0.5") == 2
    assert _value(m, ttft + "_bucket", le="+Inf") == 2
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert _value(m, name + "_count") == 3
        assert _value(m, name + "_sum") == pytest.approx(0.25)
        assert _value(m, name + "_bucket", le="0.01") == 0
        assert _value(m, name + "_bucket", le="0.025") == 1
        assert _value(m, name + "_bucket", le="0.05") == 2
        assert _value(m, name + "_bucket", le="0.2") == 3
    e2e = "vllm:e2e_request_latency_seconds"
    assert _value(m, e2e + "_count") == 2
    assert _value(m, e2e + "_sum") == pytest.approx(4.2)
    assert _value(m, e2e + "_bucket", le="1.0") == 0
    assert _value(m, e2e + "_bucket", le="1.5") == 1
    assert _value(m, e2e + "_bucket", le="5.0") == 2
    for name, total in (
        ("vllm:request_queue_time_seconds", 0.2),
        ("vllm:request_prefill_time_seconds", 0.4),
        ("vllm:request_decode_time_seconds", 1.8),
        ("vllm:request_inference_time_seconds", 2.2),
    ):
        assert _value(m, name + "_count") == 2
        assert _value(m, name + "_sum") == pytest.approx(total)


def test_token_histograms_use_1_2_5_buckets_up_to_max_model_len() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    m = EngineMetrics(MODEL, max_model_len=2048)
    _feed(m)
    name = "vllm:request_prompt_tokens"
    assert _value(m, name + "_count") == 2
    assert _value(m, name + "_sum") == 14
    assert _value(m, name + "_bucket", le="5.0") == 0
    assert _value(m, name + "_bucket", le="10.0") == 2
    assert _value(m, name + "_bucket", le="2000.0") == 2
    assert _value(m, name + "_bucket", le="5000.0") is None
    assert _value(m, "vllm:request_generation_tokens_sum") == 10
    assert _value(m, "vllm:request_params_max_tokens_sum") == 32
    assert _value(m, "vllm:request_params_n_count") == 2


def test_instances_have_separate_registries() -> None:
    a, b = EngineMetrics(MODEL), EngineMetrics(MODEL)
    _feed(a)
    assert _value(a, "vllm:prompt_tokens_total") == 12
    assert _value(b, "vllm:prompt_tokens_total") == 0


def test_record_never_raises() -> None:
    m = EngineMetrics(MODEL, include_process_metrics=False)
    m.record(SchedulerStats(), IterationStats(time_to_first_tokens=["bad"]))  # type: ignore[list-item]


def test_exposition_names() -> None:
    m = EngineMetrics(MODEL)
    _feed(m)
    text = m.render()[0].decode()
    for line in (
        'vllm:num_requests_running{model_name="smol"} 1.0',
        'vllm:prompt_tokens_total{model_name="smol"} 12.0',
        'vllm:generation_tokens_total{model_name="smol"} 5.0',
        'vllm:request_success_total{finished_reason="stop",model_name="smol"} 1.0',
        'vllm:time_to_first_token_seconds_count{model_name="smol"} 2.0',
    ):
        assert line in text.splitlines(), line
    assert "process_resident_memory_bytes" in text or "process_" not in text


def test_promtool_check_metrics() -> None:
    m = EngineMetrics(MODEL, max_model_len=4096)
    _feed(m)
    body, _ = m.render()
    assert promtool_check_metrics(body) == []


def test_promtool_catches_real_problems() -> None:
    # The helper only forgives the colon lint: a missing HELP or a parse error still fails.
    assert promtool_check_metrics(b"vllm:x 1\n") == ["vllm:x no help text"]
    assert promtool_check_metrics(b"bad{{ 1\n")


def test_openmetrics_negotiation() -> None:
    m = EngineMetrics(MODEL, include_process_metrics=False)
    _feed(m)
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    # The sample lines keep vLLM's ':' (prometheus-client's default escaping made it '_').
    prometheus_accept = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
        "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    body, content_type = m.render(prometheus_accept)
    assert content_type.startswith("application/openmetrics-text")
    assert b"\nvllm:num_requests_running{" in body and b"\nvllm_" not in body
    body, content_type = m.render(None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"


def test_mount_metrics_reads_app_state() -> None:
    import fastapi  # noqa: F401  (a dependency: fail, never skip, if missing)
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    mount_metrics(app)
    client = TestClient(app)
    # Before the engine exists: an empty exposition, never an error.
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.text == ""
    m = EngineMetrics(MODEL)
    _feed(m)
    app.state.metrics = m
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert 'vllm:prompt_tokens_total{model_name="smol"} 12.0' in r.text


def test_mount_metrics_explicit() -> None:
    import fastapi  # noqa: F401  (a dependency: fail, never skip, if missing)
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    m = EngineMetrics(MODEL, include_process_metrics=False)
    app = FastAPI()
    mount_metrics(app, m)
    r = TestClient(app).get("/metrics")
    assert 'vllm:num_requests_running{model_name="smol"} 0.0' in r.text


def test_model_info_names_the_weights_quantization() -> None:
    m = EngineMetrics(MODEL, include_process_metrics=False)
    assert _value(m, "wick:model_info", quantization="none") is None  # not loaded yet
    m.set_model_info("gptq w4 g128")
    assert _value(m, "wick:model_info", quantization="gptq w4 g128") == 1
    m.set_model_info(None)  # a reload with float weights replaces the series
    assert _value(m, "wick:model_info", quantization="gptq w4 g128") is None
    assert _value(m, "wick:model_info", quantization="none") == 1
    assert promtool_check_metrics(m.render()[0]) == []


def test_cache_config_info_carries_the_kv_cache_dtype_and_blocks() -> None:
    from model_server.engine.stats import CacheConfigInfo, record_cache_config

    m = EngineMetrics(MODEL, include_process_metrics=False)
    info = CacheConfigInfo(
        block_size=16,
        num_gpu_blocks=1371,
        cache_dtype="int8",
        kv_cache_bytes=268_431_360,
        enable_prefix_caching=True,
    )
    record_cache_config([object(), m], info)  # loggers without the hook are skipped
    labels = {
        "block_size": "16",
        "cache_dtype": "int8",
        "num_gpu_blocks": "1371",
        "kv_cache_bytes": "268431360",
        "enable_prefix_caching": "True",
    }
    assert m.registry.get_sample_value("vllm:cache_config_info", labels) == 1.0
    body, _ = m.render()
    assert promtool_check_metrics(body) == []
