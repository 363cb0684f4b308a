"""Nothing per request outlives the request: after rounds of mixed traffic over a real socket
(whole and streamed answers, streams the client drops, n > 1, malformed requests), the server's
per-request tables are empty and the live objects of the per-request types are back to their
count after the first round. The soak (`bench soak`) watches the same thing as resident memory
over minutes; this is its exact, untimed form."""

from __future__ import annotations

import gc
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from model_server.engine.async_engine import AsyncLLM, RequestOutputCollector
from model_server.engine.core.request import Request
from model_server.engine.output_processor import _RequestState
from model_server.engine.outputs import RequestOutput
from model_server.engine.stats_tracker import _RequestTimes
from model_server.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL_NAME, tiny_settings
from tests.loopback import serve_asgi

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PER_REQUEST_TYPES = (Request, RequestOutputCollector, _RequestState, _RequestTimes, RequestOutput)
BAD_BODIES: tuple[Any, ...] = (
    {"messages": [{"role": "user"}]},  # no content
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"},
    {"prompt": [1, 2, 3], "max_tokens": 100_000},  # longer than the context
)


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], **extra}


def _round(http: httpx.Client, i: int) -> int:
    """One round of every kind of request; returns how many streams it dropped mid-answer."""
    assert http.post(CHAT, json=_chat(f"hello {i}", max_tokens=8)).status_code == 200
    body = {"model": MODEL_NAME, "prompt": f"count {i}:" * (i + 1), "max_tokens": 6, "n": 2}
    assert http.post(COMPLETIONS, json=body).status_code == 200
    streamed = _chat(f"stream {i}", max_tokens=8, stream=True)
    with http.stream("POST", CHAT, json=streamed) as resp:
        assert resp.status_code == 200
        data = [line for line in resp.iter_lines() if line.startswith("data:")]
        assert data[-1] == "data: [DONE]"
    dropped = 0
    long = _chat(f"a long story {i}", max_tokens=200, ignore_eos=True, stream=True)
    with http.stream("POST", CHAT, json=long) as resp:
        assert resp.status_code == 200
        pieces = 0
        for line in resp.iter_lines():
            pieces += line.startswith("data:")
            if pieces == 2:
                dropped += 1
                break  # leaving the block drops the connection mid-answer
    for bad in BAD_BODIES:
        path = COMPLETIONS if "prompt" in bad else CHAT
        assert 400 <= http.post(path, json={"model": MODEL_NAME, **bad}).status_code < 500
    truncated = b'{"messages": [{"role": "user", "content": "hi"'
    resp = http.post(CHAT, content=truncated, headers={"Content-Type": "application/json"})
    assert 400 <= resp.status_code < 500
    return dropped


def _wait_idle(llm: AsyncLLM, timeout: float = 60) -> None:
    scheduler = llm._engine.scheduler
    deadline = time.monotonic() + timeout
    while llm.num_unfinished_requests or scheduler.requests or scheduler.kv_cache_usage:
        assert time.monotonic() < deadline, "the engine did not settle"
        time.sleep(0.05)
    time.sleep(0.2)  # the iteration that applied the last abort records its stats


def _live_per_request_objects() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects() if type(o) in PER_REQUEST_TYPES)


def _tables(llm: AsyncLLM) -> dict[str, int]:
    engine = llm._engine
    return {
        "collectors": len(llm._collectors),
        "scheduler.requests": len(engine.scheduler.requests),
        "output_processor.requests": len(engine.output_processor._requests),
        "output_processor.children": len(engine.output_processor._children),
        "stats.requests": len(llm._tracker._requests),
        "stats.unscheduled": len(llm._tracker._unscheduled),
    }


def _aborted(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort series in /metrics")


def test_no_per_request_state_outlives_its_request(tiny_config: Path) -> None:
    settings = tiny_settings(tiny_config)
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    app = build_app(llm, settings)
    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        deadline = time.monotonic() + 60
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        _round(http, 0)  # first use: lazy inits, caches
        _wait_idle(llm)
        baseline = _live_per_request_objects()
        aborted_before = _aborted(http.get("/metrics").text)
        dropped = sum(_round(http, i) for i in range(1, 4))
        _wait_idle(llm)
        assert _tables(llm) == dict.fromkeys(_tables(llm), 0)
        assert _live_per_request_objects() == baseline
        # The dropped streams really were cut mid-answer (aborted in the engine, not finished).
        assert _aborted(http.get("/metrics").text) - aborted_before == dropped == 3
