"""Backpressure, request ids and message checks at the model server's HTTP boundary
(in-process: the real app and AsyncLLM over the tiny model, or over a fake engine whose steps
the test releases). SIGTERM drain over a real socket is in tests/e2e/test_model_server.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from model_server.engine.async_engine import AsyncLLM
from tests.engine.test_async_engine import FakeEngine
from tests.entrypoints.conftest import AppClient, start_app, tiny_settings
from tests.entrypoints.test_openai_api import CHAT, COMPLETIONS, assert_error

TOKENS = {"prompt": [1, 2, 3], "max_tokens": 4}


def gated_app(tiny_config: Path, **settings: Any) -> tuple[AppClient, AsyncLLM, FakeEngine]:
    """The app over a fake engine that takes no step until the test releases `step_gate`."""
    engines: list[FakeEngine] = []

    def factory(config: Any) -> FakeEngine:
        engine = FakeEngine(config)
        engine.step_gate = threading.Semaphore(0)
        engines.append(engine)
        return engine

    s = tiny_settings(tiny_config, **settings)
    llm = AsyncLLM(s.engine_config(), engine_factory=factory, skip_warmup=True)
    client = start_app(s, llm)
    client.call(llm.wait_until_ready(10))
    return client, llm, engines[0]


def in_background(client: AppClient) -> Future[Any]:
    """POST TOKENS to /v1/completions without waiting for the answer."""
    return asyncio.run_coroutine_threadsafe(
        client.client.post(COMPLETIONS, json=TOKENS), client.loop
    )


def test_past_max_waiting_requests_new_ones_get_503_with_retry_after(tiny_config: Path) -> None:
    client, llm, engine = gated_app(tiny_config, max_waiting_requests=2)
    try:
        # Two requests wait (no step runs): the queue is full.
        waiting = [
            asyncio.run_coroutine_threadsafe(
                client.client.post(COMPLETIONS, json=TOKENS), client.loop
            )
            for _ in range(2)
        ]
        deadline = time.monotonic() + 10
        while llm.num_waiting_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        refused = client.post(COMPLETIONS, json=TOKENS)
        assert time.monotonic() - started < 1.0  # at once, not after the queue moved
        error = assert_error(refused, 503, "--max-waiting-requests 2")
        assert error["code"] == "overloaded" and refused.headers["retry-after"] == "1"
        streamed = client.post(COMPLETIONS, json={**TOKENS, "stream": True})
        assert streamed.status_code == 503 and streamed.headers["retry-after"] == "1"
        engine.step_gate.release(1000)
        assert [f.result(30).status_code for f in waiting] == [200, 200]
        assert client.post(COMPLETIONS, json=TOKENS).status_code == 200  # room again
    finally:
        engine.step_gate.release(1000)
        client.close()


def test_zero_is_no_limit(tiny_config: Path) -> None:
    # auto would be 4 x --max-num-seqs 1 = 4 waiting: the sixth request would get 503.
    client, llm, engine = gated_app(tiny_config, max_waiting_requests=0, max_num_seqs=1)
    try:
        futures = [
            asyncio.run_coroutine_threadsafe(
                client.client.post(COMPLETIONS, json=TOKENS), client.loop
            )
            for _ in range(6)
        ]
        deadline = time.monotonic() + 10
        while llm.num_unfinished_requests < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.step_gate.release(1000)
        assert [f.result(30).status_code for f in futures] == [200] * 6
    finally:
        engine.step_gate.release(1000)
        client.close()


# ------------------------------------------------------------------------------ request ids


def test_the_clients_request_id_is_the_engines_and_comes_back(
    api: AppClient, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    with caplog.at_level(logging.INFO, logger="model_server.requests"):
        resp = api.post(CHAT, json=body, headers={"X-Request-Id": "trace-7"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "trace-7"
    assert resp.json()["id"] == "chatcmpl-trace-7"
    assert any("request trace-7: POST /v1/chat/completions -> 200" in r.message
               for r in caplog.records)  # fmt: skip


def test_a_request_without_an_id_gets_the_one_in_its_body(api: AppClient) -> None:
    resp = api.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    made = resp.headers["x-request-id"]
    assert len(made) == 32 and resp.json()["id"] == f"cmpl-{made}"
    again = api.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
    assert again.headers["x-request-id"] != made


def test_a_malformed_request_id_is_400(api: AppClient) -> None:
    resp = api.post(COMPLETIONS, json={"prompt": "Hi"}, headers={"X-Request-Id": "a b"})
    assert_error(resp, 400, "X-Request-Id")
    assert api.get("/health").headers["x-request-id"]  # every answer carries one


# ------------------------------------------------------------------------- message content


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_a_message_without_content_is_400(api: AppClient, role: str) -> None:
    messages = [{"role": role}, {"role": "user", "content": "Hi"}]
    if role == "user":
        messages = [{"role": "user"}]
    resp = api.post(CHAT, json={"messages": messages, "max_tokens": 2})
    error = assert_error(resp, 400, f"a {role} message must have `content`")
    assert error["param"] == "messages"


def test_an_assistant_message_may_omit_content(api: AppClient) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant"},
        {"role": "user", "content": "Again"},
    ]
    assert api.post(CHAT, json={"messages": messages, "max_tokens": 2}).status_code == 200
