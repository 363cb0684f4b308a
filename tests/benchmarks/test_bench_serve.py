"""`bench serve`: SSE timing and token counting, the statistics, and a run against a fake server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from model_server.benchmarks.openai_stream import (
    RequestResult,
    build_payload,
    stream_request,
)
from model_server.benchmarks.random_prompts import sample_requests
from model_server.benchmarks.serve import parse_percentiles, run_serve_benchmark
from model_server.benchmarks.serve_metrics import calculate_metrics, format_report, result_json
from model_server.entrypoints.cli import build_parser
from tests.fake_openai_server import FakeOpenAI, serve

# -- statistics -------------------------------------------------------------------------------


def _ok(ttft: float, latency: float, out: int, itl: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(
        success=True, prompt_len=prompt, output_tokens=out, ttft=ttft, itl=itl, latency=latency
    )


def test_calculate_metrics_exact() -> None:
    results = [
        _ok(0.1, 1.1, 11, [0.1] * 10),
        _ok(0.2, 2.2, 5, [0.5, 0.5, 0.5, 0.5], prompt=20),
        _ok(0.3, 0.3, 1, []),  # one token: no TPOT
        RequestResult(success=False, prompt_len=99, output_tokens=7, error="HTTP 500"),
    ]
    m = calculate_metrics(results, duration_s=4.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 40  # failed requests count nothing
    assert m.total_output == 17
    assert m.request_throughput == pytest.approx(0.75)
    assert m.output_throughput == pytest.approx(17 / 4)
    assert m.total_token_throughput == pytest.approx(57 / 4)
    ttft = m.latencies["ttft"]
    assert ttft.mean_ms == pytest.approx(200.0)
    assert ttft.median_ms == pytest.approx(200.0)
    assert ttft.std_ms == pytest.approx(np.std([100, 200, 300]))
    assert ttft.percentiles_ms[0] == (50, pytest.approx(200.0))
    # Linear interpolation: 200 + 0.98 · (300 − 200).
    assert ttft.percentiles_ms[1] == (99, pytest.approx(298.0))
    tpot = m.latencies["tpot"]  # (1.1-0.1)/10 = 0.1 s, (2.2-0.2)/4 = 0.5 s
    assert tpot.mean_ms == pytest.approx(300.0)
    assert tpot.percentiles_ms[1][1] == pytest.approx(100 + 0.99 * 400)
    itl = m.latencies["itl"]  # ten 0.1 s gaps and four 0.5 s gaps
    assert itl.mean_ms == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert itl.median_ms == pytest.approx(100.0)
    e2el = m.latencies["e2el"]
    assert e2el.mean_ms == pytest.approx(1200.0)
    assert e2el.median_ms == pytest.approx(1100.0)


def test_no_successful_request_gives_zeros() -> None:
    m = calculate_metrics([RequestResult(error="x")], 1.0, [99])
    assert (m.completed, m.failed, m.total_output) == (0, 1, 0)
    assert m.latencies["ttft"].mean_ms == 0.0


def test_report_layout_and_json() -> None:
    results = [_ok(0.1, 1.1, 11, [0.1] * 10)]
    m = calculate_metrics(results, 2.0, [99])
    text = format_report(m, max_concurrency=4)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     1         " in lines
    assert "Maximum request concurrency:             4         " in lines
    assert "Output token throughput (tok/s):         5.50      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Mean TTFT (ms):                          100.00    " in lines
    assert "P99 TPOT (ms):                           100.00    " in lines
    assert "Median ITL (ms):                         100.00    " in lines
    assert "Mean E2EL (ms):                          1100.00   " in lines
    assert "Request rate configured" not in text
    data = result_json(m, results, model_id="m")
    assert data["model_id"] == "m"
    assert data["completed"] == 1
    assert data["total_output_tokens"] == 11
    assert data["p99_ttft_ms"] == pytest.approx(100.0)
    assert data["mean_tpot_ms"] == pytest.approx(100.0)
    assert data["output_lens"] == [11]
    json.dumps(data)  # serializable


def test_parse_percentiles() -> None:
    assert parse_percentiles("50,90, 99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


# -- one streaming request ----------------------------------------------------------------------


def _sse(*events: dict | str) -> bytes:
    out = []
    for e in events:
        out.append("data: " + (e if isinstance(e, str) else json.dumps(e)) + "\n\n")
    return "".join(out).encode()


def _run_stream(body: bytes, status: int = 200, payload: dict | None = None) -> RequestResult:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_request(
                client,
                "http://test/v1/completions",
                payload or {"prompt": "hi", "stream": True},
                prompt_len=3,
            )

    return asyncio.run(go())


def _text(t: str) -> dict:
    return {"choices": [{"index": 0, "text": t}]}


def test_stream_counts_tokens_from_usage() -> None:
    body = _sse(
        _text("a"),
        _text(""),  # e.g. a held-back partial character: no text, no timing
        _text("b"),
        _text("c"),
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}},
        "[DONE]",
    )
    r = _run_stream(body)
    assert r.success, r.error
    assert r.usage_reported
    assert r.output_tokens == 4  # usage wins over the 3 text chunks
    assert r.prompt_len == 7  # the server's count replaces the client's 3
    assert r.generated_text == "abc"
    assert len(r.itl) == 2
    assert 0 < r.ttft <= r.latency


def test_stream_without_usage_counts_text_chunks() -> None:
    r = _run_stream(_sse(_text("a"), _text("b"), _text(""), _text("c"), "[DONE]"))
    assert r.success
    assert not r.usage_reported
    assert r.output_tokens == 3
    assert r.prompt_len == 3


def test_stream_chat_deltas() -> None:
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        "[DONE]",
    )
    r = _run_stream(body, payload={"messages": [], "stream": True})
    assert r.success
    assert r.generated_text == "Hello"
    assert r.output_tokens == 2
    assert len(r.itl) == 1


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (b'{"error": {"message": "bad"}}', 400, "HTTP 400"),
        (_sse({"error": {"message": "oom"}}), 200, "error in stream"),
        (_sse("[DONE]"), 200, "no text"),
        (b"data: {not json\n\n", 200, "JSONDecodeError"),
    ],
)
def test_stream_failures(body: bytes, status: int, error: str) -> None:
    r = _run_stream(body, status)
    assert not r.success
    assert error in r.error


def test_payload() -> None:
    p = build_payload(model="m", prompt="x", max_tokens=5, chat=False, ignore_eos=True)
    assert p == {
        "model": "m",
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": "x",
        "max_tokens": 5,
        "ignore_eos": True,
    }
    p = build_payload(model="m", prompt="x", max_tokens=5, chat=True)
    assert p["messages"] == [{"role": "user", "content": "x"}]
    assert p["max_completion_tokens"] == 5
    assert "ignore_eos" not in p


# -- prompts ------------------------------------------------------------------------------------


class _CharTokenizer:
    """One token per character of 'abcdefgh'; id 0 is special."""

    vocab = "#abcdefgh"
    all_special_ids = (0,)

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.index(c) for c in text]


def test_random_prompts() -> None:
    a = sample_requests(20, 10, 8, range_ratio=0.5, seed=3)
    assert a == sample_requests(20, 10, 8, range_ratio=0.5, seed=3)
    assert a != sample_requests(20, 10, 8, range_ratio=0.5, seed=4)
    assert all(5 <= r.prompt_len <= 15 and 4 <= r.output_len <= 12 for r in a)
    assert all(len(r.prompt.split()) == r.prompt_len for r in a)
    assert len({r.prompt_len for r in a}) > 1
    fixed = sample_requests(5, 10, 8, seed=0)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(10, 8)}
    tok = sample_requests(5, 12, 3, seed=0, tokenizer=_CharTokenizer())
    assert all(len(r.prompt) == 12 == r.prompt_len and "#" not in r.prompt for r in tok)
    with pytest.raises(ValueError):
        sample_requests(0, 10, 8)
    with pytest.raises(ValueError):
        sample_requests(1, 10, 8, range_ratio=1.0)


# -- against a fake server ----------------------------------------------------------------------


def _args(base_url: str, *extra: str):
    return build_parser().parse_args(
        ["bench", "serve", "--base-url", base_url, "--tokenizer", "none", "--disable-tqdm", *extra]
    )


def test_bench_serve_against_fake_server(tmp_path, capsys) -> None:
    fake = FakeOpenAI(delay_s=0.002)
    out = tmp_path / "result.json"
    with serve(fake) as url:
        args = _args(
            url,
            *("--num-prompts", "6", "--random-input-len", "5", "--random-output-len", "4"),
            *("--max-concurrency", "2", "--ignore-eos", "--save-result", str(out)),
        )
        assert run_serve_benchmark(args) == 0
    printed = capsys.readouterr().out
    assert "Successful requests:                     6" in printed
    assert "Total generated tokens:                  24" in printed
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["failed"] == 0
    assert data["model_id"] == "fake-model"  # from /v1/models
    assert data["total_input_tokens"] == 30  # usage: 5 words each
    assert data["total_output_tokens"] == 24
    assert data["max_concurrency"] == 2
    assert all(len(itl) == 3 for itl in data["itls"])
    assert data["mean_ttft_ms"] > 0 and data["mean_e2el_ms"] >= data["mean_ttft_ms"]
    # 7 requests: the initial test request, then the 6 of the run; all stream and ask for usage.
    assert len(fake.requests) == 7
    assert all(r["ignore_eos"] and r["stream"] and r["max_tokens"] == 4 for r in fake.requests)
    assert all(r["stream_options"] == {"include_usage": True} for r in fake.requests)


def test_bench_serve_counts_chunks_and_failures(tmp_path) -> None:
    fake = FakeOpenAI(report_usage=False, fail_every=3)
    out = tmp_path / "r.json"
    with serve(fake) as url:
        args = _args(
            url,
            *("--num-prompts", "8", "--random-input-len", "3", "--random-output-len", "5"),
            *("--request-rate", "500", "--endpoint", "/v1/chat/completions", "--model", "m"),
            *("--save-result", str(out)),
        )
        assert run_serve_benchmark(args) == 0
    data = json.loads(out.read_text())
    # Requests 3, 6 and 9 of 9 (the test request, then the eight counted ones) fail.
    assert (data["completed"], data["failed"]) == (5, 3)
    assert data["model_id"] == "m"
    assert data["request_rate"] == 500
    # Chat answers "you said: <3 words>" = 5 words, counted as text chunks without usage.
    assert data["total_output_tokens"] == 25
    assert data["total_input_tokens"] == 15  # client-side word counts
    assert sum(1 for e in data["errors"] if e.startswith("HTTP 500")) == 3


def test_bench_serve_unreachable_server() -> None:
    args = _args("http://127.0.0.1:9", "--num-prompts", "1", "--ready-check-timeout-sec", "0")
    with pytest.raises(RuntimeError, match="cannot list models"):
        run_serve_benchmark(args)


def test_cli_bench_serve(tmp_path) -> None:
    flags = [
        "--base-url",
        "--endpoint",
        "--model",
        "--tokenizer",
        "--num-prompts",
        "--random-input-len",
        "--random-output-len",
        "--random-range-ratio",
        "--max-concurrency",
        "--request-rate",
        "--ignore-eos",
        "--seed",
        "--save-result",
    ]
    help_text = subprocess.run(
        [sys.executable, "-m", "model_server", "bench", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert all(f in help_text for f in flags)
    out = tmp_path / "cli.json"
    with serve(FakeOpenAI()) as url:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "model_server",
                "bench",
                "serve",
                "--base-url",
                url,
                "--tokenizer",
                "none",
                "--num-prompts",
                "3",
                "--random-output-len",
                "2",
                "--save-result",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    assert json.loads(out.read_text())["total_output_tokens"] == 6


def test_ready_check_waits_for_a_starting_server(tmp_path) -> None:
    fake = FakeOpenAI(unready_requests=2)
    out = tmp_path / "r.json"
    with serve(fake) as url:
        args = _args(url, "--num-prompts", "2", "--ready-check-timeout-sec", "20")
        assert run_serve_benchmark(_with_save(args, out)) == 0
    assert len(fake.requests) == 5  # two 503s, the test request, the two counted
    assert json.loads(out.read_text())["completed"] == 2


def test_ready_check_fails_at_once_on_4xx() -> None:
    with serve(FakeOpenAI()) as url:
        args = _args(url, "--endpoint", "/v1/nope", "--ready-check-timeout-sec", "600")
        with pytest.raises(RuntimeError, match="HTTP 404"):
            run_serve_benchmark(args)


def _with_save(args, path):
    args.save_result = str(path)
    return args


def test_bench_serve_reports_prefix_cache_hits_of_repeated_prompts(tmp_path, capsys) -> None:
    fake = FakeOpenAI(prefix_cache=True)
    rates = []
    with serve(fake) as url:
        for run, seed in enumerate(("0", "0", "1")):
            out = tmp_path / f"r{run}.json"
            argv = ("--num-prompts", "6", "--random-input-len", "5", "--random-output-len", "2")
            args = _args(url, *argv, "--seed", seed, "--save-result", str(out))
            assert run_serve_benchmark(args) == 0
            rates.append(json.loads(out.read_text())["prefix_cache_hit_rate"])
            captured = capsys.readouterr()
            assert f"Server prefix cache hit rate (%):        {100 * rates[-1]:<10.2f}" in (
                captured.out.splitlines()
            )
            assert ("warning: the server answered" in captured.err) == (run == 1)
    # Run 1: only the first prompt, already sent by the initial test request, is cached.
    # Run 2 repeats run 1's prompts; run 3's seed gives new ones (its test request primes one).
    assert rates == [pytest.approx(1 / 6), 1.0, pytest.approx(1 / 6)]


def test_bench_serve_without_server_counters_reports_none(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    with serve(FakeOpenAI()) as url:  # no /metrics: like llama.cpp's server
        args = _args(
            url, "--num-prompts", "2", "--random-output-len", "2", "--save-result", str(out)
        )
        assert run_serve_benchmark(args) == 0
    assert json.loads(out.read_text())["prefix_cache_hit_rate"] is None
    assert "prefix cache hit rate" not in capsys.readouterr().out


def test_parse_prefix_counters_sums_label_sets() -> None:
    from model_server.benchmarks.prefix_hits import PrefixCounters, parse_prefix_counters

    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="a"} 10.0\n'
        'vllm:prefix_cache_queries_created{model_name="a"} 1.7e9\n'
        'vllm:prefix_cache_queries_total{model_name="b"} 5.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="a"} 4.0\n'
    )
    assert parse_prefix_counters(text) == PrefixCounters(queries=15.0, hits=4.0)
    assert parse_prefix_counters("# TYPE other counter\nother_total 1.0\n") is None
    assert parse_prefix_counters("not { prometheus") is None


def test_copy_workloads_and_the_copy_share() -> None:
    from model_server.benchmarks.copy_workloads import copy_share, workload_requests

    editing = workload_requests("editing", 10, 64, seed=0, tokenizer=None)
    assert len(editing) == 10 and all(r.output_len == 64 for r in editing)
    assert len({r.prompt for r in editing}) == 8  # every passage, then round robin
    assert editing == workload_requests("editing", 10, 64, seed=0, tokenizer=None)
    assert [r.prompt for r in editing] != [
        r.prompt for r in workload_requests("editing", 10, 64, seed=1, tokenizer=None)
    ]
    first = editing[0].prompt
    assert first.startswith("Rewrite the passage below word for word")
    assert editing[0].prompt_len == len(first.split())
    rag = workload_requests("rag", 1, 8, seed=0, tokenizer=None)[0].prompt
    assert rag.count("Passage ") == 3 and "Question: " in rag
    with pytest.raises(ValueError, match="unknown workload"):
        workload_requests("poems", 1, 8, seed=0, tokenizer=None)
    passage = first.split("\n\n", 1)[1]
    # The passage copied: every trigram found; an unrelated answer: none; no trigram: None.
    assert copy_share([first], [passage]) == 1.0
    assert copy_share([first], ["purple elephants dance quietly tonight"]) == 0.0
    assert copy_share([first], ["two words"]) is None


def test_bench_serve_editing_reports_copy_share_and_acceptance(tmp_path, capsys) -> None:
    """--dataset-name editing through the chat endpoint of a fake server that echoes the prompt
    and counts speculative decoding: the copy share and the acceptance the counters give."""
    fake = FakeOpenAI(spec_decode=True)
    with serve(fake) as url:
        args = _args(
            url,
            *("--dataset-name", "editing", "--endpoint", "/v1/chat/completions"),
            *("--num-prompts", "4", "--random-output-len", "32"),
        )
        assert run_serve_benchmark(args) == 0
    out = capsys.readouterr().out
    assert all("Rewrite the passage below" in r["messages"][0]["content"] for r in fake.requests)
    # 4 run requests (the initial test request came before the first reading): 8 drafts of
    # 24 tokens, 16 accepted.
    assert (
        "speculative decoding: 8 drafts of 24 tokens, 16 accepted (66.7%); "
        "mean acceptance length 3.00"
    ) in out
    share = float(out.split("answers' word trigrams found in their prompt: ")[1].split("%")[0])
    assert share > 90.0


def test_parse_spec_counters() -> None:
    from model_server.benchmarks.spec_counters import SpecCounters, parse_spec_counters, spec_delta

    text = (
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="a"} 10.0\n'
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        'vllm:spec_decode_num_draft_tokens_total{model_name="a"} 30.0\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{model_name="a"} 12.0\n'
    )
    after = parse_spec_counters(text)
    assert after == SpecCounters(10.0, 30.0, 12.0)
    assert parse_spec_counters("# TYPE other counter\nother_total 1.0\n") is None
    before = SpecCounters(4.0, 12.0, 6.0)
    assert spec_delta(before, after) == SpecCounters(6.0, 18.0, 6.0)
    assert spec_delta(after, after) is None and spec_delta(None, after) is None
