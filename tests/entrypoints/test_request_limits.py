"""Hostile input and overload at the model server's HTTP boundary, over real HTTP on loopback.

The hostile requests go to the embedded SmolLM2 served as `serve` serves it (default limits),
each beside an ordinary chat that must still answer; every one is answered, with a message
naming the limit or the problem, within ANSWER_WITHIN_S. Backpressure runs over a fake engine
whose steps the test releases (tests/engine/test_async_engine.py), so the queue holds still.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_server.engine.async_engine import AsyncLLM, EngineOverloadedError
from model_server.entrypoints.openai.api_server import build_app
from model_server.entrypoints.openai.request_limits import (
    RequestLimits,
    _keeps_characters,
    max_chars_per_token,
)
from model_server.loader.embedded import embedded_model_available
from model_server.settings import ServerSettings
from model_server.settings_spec import parse_byte_count, resolve_max_waiting_requests
from tests.engine.test_async_engine import FakeEngine, collect, started
from tests.entrypoints.conftest import start_app, tiny_settings
from tests.entrypoints.test_openai_api import CHAT, COMPLETIONS, assert_error
from tests.loopback import serve_asgi

ANSWER_WITHIN_S = 5.0
TOKENIZE = "/tokenize"
HELLO = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
JSON = {"content-type": "application/json"}


@dataclass
class Served:
    url: str
    llm: AsyncLLM
    client: httpx.Client


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The embedded model behind the real app on a loopback port, every limit at its default."""
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 is not installed")
    settings = ServerSettings(
        max_model_len=2048, kv_cache_memory="64MiB", skip_warmup=True, access_log=False
    )
    llm = AsyncLLM(settings.engine_config(), skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url, httpx.Client(base_url=url, timeout=60) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model server did not get ready"
            time.sleep(0.1)
        yield Served(url, llm, c)


def ordinary_chat(url: str) -> httpx.Response:
    body = {**HELLO, "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.post(CHAT, json=body)


def beside_a_chat(served: Served, send: Callable[[httpx.Client], httpx.Response]) -> httpx.Response:
    """`send` while an ordinary chat is in flight; checks that it answered in time and that the
    chat still answered, and returns its response."""
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(ordinary_chat, served.url)
        started_at = time.monotonic()
        resp = send(served.client)
        elapsed = time.monotonic() - started_at
        answer = chat.result(60)
    assert elapsed < ANSWER_WITHIN_S, f"answered in {elapsed:.1f}s: {resp.text[:200]}"
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]
    return resp


def post_json(path: str, body: Any) -> Callable[[httpx.Client], httpx.Response]:
    return lambda client: client.post(path, json=body)


def post_raw(path: str, raw: str | bytes) -> Callable[[httpx.Client], httpx.Response]:
    return lambda client: client.post(path, content=raw, headers=JSON)


# ------------------------------------------------------------------------------ counted limits


def test_100000_prompts_get_400_at_once_and_queue_nothing(served: Served) -> None:
    flood = {"prompt": ["hi"] * 100_000, "max_tokens": 1}
    llm = served.llm
    in_engine = watch(lambda: llm.num_unfinished_requests + llm.num_waiting_requests)
    try:
        started_at = time.monotonic()
        resp = served.client.post(COMPLETIONS, json=flood)
        assert time.monotonic() - started_at < ANSWER_WITHIN_S
    finally:
        seen = in_engine()
    error = assert_error(resp, 400, "100000 prompts")
    assert "--max-prompts-per-request 256" in error["message"]
    assert error["param"] == "prompt" and error["code"] == "array_above_max_length"
    assert seen == 0  # not one prompt was admitted, let alone queued, at any moment
    # And beside a chat, which still answers.
    assert_error(beside_a_chat(served, post_json(COMPLETIONS, flood)), 400, "100000 prompts")


def watch(read: Callable[[], int]) -> Callable[[], int]:
    """Sample `read()` on a thread until the returned callable stops it; that gives the max."""
    stop = threading.Event()
    most = [read()]

    def loop() -> None:
        while not stop.is_set():
            most[0] = max(most[0], read())
            time.sleep(0.001)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def done() -> int:
        stop.set()
        thread.join(5)
        return max(most[0], read())

    return done


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_too_many_stop_strings_are_400(served: Served, path: str) -> None:
    body = {**HELLO, "prompt": "Hi", "stop": [f"s{i}" for i in range(33)], "max_tokens": 2}
    resp = beside_a_chat(served, post_json(path, body))
    error = assert_error(resp, 400, "33 stop strings in one request")
    assert "--max-stop-strings 32" in error["message"] and error["param"] == "stop"


def test_a_too_long_stop_string_is_400(served: Served) -> None:
    body = {**HELLO, "stop": ["END", "x" * 1025], "max_tokens": 2}
    resp = beside_a_chat(served, post_json(CHAT, body))
    error = assert_error(resp, 400, "stop[1]: 1025 characters")
    assert "--max-stop-string-length 1024" in error["message"]
    assert error["code"] == "string_above_max_length"


def test_too_many_tools_are_400(served: Served) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    resp = beside_a_chat(served, post_json(CHAT, {**HELLO, "tools": tools, "max_tokens": 2}))
    error = assert_error(resp, 400, "129 tools in one request")
    assert "--max-tools 128" in error["message"] and error["param"] == "tools"


def test_200000_messages_are_400_on_chat_and_tokenize(served: Served) -> None:
    messages = [{"role": "user", "content": "hi"}] * 200_000
    for path in (CHAT, TOKENIZE):
        resp = beside_a_chat(served, post_json(path, {"messages": messages}))
        error = assert_error(resp, 400, "200000 messages in one request")
        assert "--max-messages 4096" in error["message"] and error["param"] == "messages"


def test_the_largest_allowed_counts_still_pass(served: Served) -> None:
    stop = [f"never{i}" for i in range(31)] + ["x" * 1024]
    resp = served.client.post(CHAT, json={**HELLO, "stop": stop, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    resp = served.client.post(COMPLETIONS, json={"prompt": ["Hi"] * 256, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 256
    # 128 tools pass the limit and are templated: their schemas outgrow this 2048-token context.
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)]
    resp = served.client.post(CHAT, json={**HELLO, "tools": tools, "max_tokens": 2})
    assert_error(resp, 400, "This model's maximum context length is 2048 tokens")


# ---------------------------------------------------------------------------------- body size

TOO_BIG = 32 * 1024 * 1024 + 1  # the default --max-request-body-size, and one byte


def big_body(size: int) -> bytes:
    head, tail = b'{"prompt": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def test_a_body_over_the_limit_by_content_length_is_413(served: Served) -> None:
    body = big_body(TOO_BIG)
    resp = beside_a_chat(served, post_raw(TOKENIZE, body))
    error = assert_error(resp, 413, f"the request body is {TOO_BIG} bytes")
    assert "--max-request-body-size 32MiB" in error["message"]
    # The connection stays usable: the server read the rest and dropped it.
    assert served.client.post(TOKENIZE, json={"prompt": "hello"}).status_code == 200


def test_a_content_length_over_the_limit_is_refused_before_any_body_is_sent(
    served: Served,
) -> None:
    """curl's `Expect: 100-continue`: the answer is 413, not "go on", and no body byte is read."""
    host, port = served.url.removeprefix("http://").split(":")
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * 1024**3}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=ANSWER_WITHIN_S) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert "10737418240 bytes, over the limit of 32MiB" in error["message"]
    assert "LLM_MAX_REQUEST_BODY_SIZE" in error["message"]


def test_a_chunked_body_over_the_limit_is_413(served: Served) -> None:
    body = big_body(TOO_BIG)

    def chunked(client: httpx.Client) -> httpx.Response:
        chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
        return client.post(CHAT, content=chunks, headers=JSON)  # no Content-Length

    resp = beside_a_chat(served, chunked)
    error = assert_error(resp, 413, "more than 33554432 bytes (chunked)")
    assert "--max-request-body-size 32MiB" in error["message"]


def test_a_body_at_the_limit_is_read(served: Served) -> None:
    resp = served.client.post(TOKENIZE, content=big_body(TOO_BIG - 1), headers=JSON)
    # Past the body limit's check: the prompt's own length check answers.
    assert_error(resp, 400, "more than any prompt this model takes can have")


# ------------------------------------------------------------------------------ text problems

SURROGATE = '"Hello \\ud800 world"'  # JSON's escape of a lone high surrogate


@pytest.mark.parametrize(
    ("path", "raw", "where"),
    [
        (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        (COMPLETIONS, '{"prompt": %s, "max_tokens": 2}', "prompt"),
        (COMPLETIONS, '{"prompt": ["ok", %s], "max_tokens": 2}', "prompt[1]"),
        (TOKENIZE, '{"prompt": %s}', "prompt"),
        (TOKENIZE, '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": [%s]}', "stop[0]"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "model": %s}', "model"),
    ],
)
def test_a_lone_surrogate_is_400_naming_where(
    served: Served, path: str, raw: str, where: str
) -> None:
    resp = beside_a_chat(served, post_raw(path, raw % SURROGATE))
    error = assert_error(resp, 400, f"{where}: contains a lone UTF-16 surrogate (\\ud800)")
    assert "at character 6" in error["message"]
    assert error["param"] == where.split("[")[0].split(".")[0]


def test_a_surrogate_pair_is_text(served: Served) -> None:
    # The escapes of one astral character (U+1F600) are not lone: they join into it.
    resp = served.client.post(TOKENIZE, content='{"prompt": "\\ud83d\\ude00"}', headers=JSON)
    assert resp.status_code == 200, resp.text
    assert served.llm.tokenizer.decode(resp.json()["tokens"]) == "\U0001f600"


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        (TOKENIZE, {"prompt": "x" * 10_000_000}, "prompt: 10000000 characters"),
        (CHAT, {"messages": [{"role": "user", "content": "ab " * 3_000_000}]}, "messages: "),
        (COMPLETIONS, {"prompt": ["Hi", "y" * 5_000_000], "max_tokens": 1}, "prompt[1]: "),
    ],
)
def test_text_longer_than_any_prompt_is_400_without_tokenizing_it(
    served: Served, path: str, body: dict, where: str
) -> None:
    resp = beside_a_chat(served, post_json(path, body))
    error = assert_error(resp, 400, where)
    assert (
        "more than any prompt this model takes can have: its context is 2048 tokens"
        in (error["message"])
    )
    assert error["code"] == "context_length_exceeded"


def test_the_character_bound_holds_for_the_embedded_tokenizer(served: Served) -> None:
    """Text at most `per_token` characters a token: the bound only refuses what cannot fit."""
    tokenizer = served.llm.tokenizer
    per_token = max_chars_per_token(tokenizer)
    assert per_token is not None and 16 <= per_token <= 128
    runs = ["#", "=", "-", " ", "\n", "\t", "a", "ab", "é", "日本", "😀", "\n    "]
    for text in [run * 4000 for run in runs] + ["".join(map(chr, range(32, 20000)))]:
        num_tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert len(text) <= per_token * num_tokens, repr(text[:20])


def test_normalizers_that_drop_or_merge_characters_give_no_bound() -> None:
    from tokenizers import normalizers, pre_tokenizers

    keeping = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert _keeps_characters(None) and _keeps_characters(keeping)
    assert _keeps_characters(pre_tokenizers.ByteLevel())
    for dropping in (
        normalizers.NFC(),  # composes: two characters become one
        normalizers.StripAccents(),
        normalizers.Replace("  ", " "),
        pre_tokenizers.Whitespace(),
        pre_tokenizers.Split(" ", behavior="removed"),
    ):
        assert not _keeps_characters(dropping), dropping


# ---------------------------------------------------------------------------- configured limits


def test_the_limits_come_from_the_settings(tiny_config: Path) -> None:
    client = start_app(
        tiny_settings(tiny_config, max_prompts_per_request=3, max_stop_strings=0, max_messages=2)
    )
    try:
        resp = client.post(COMPLETIONS, json={"prompt": [[1, 2]] * 4, "max_tokens": 1})
        assert_error(resp, 400, "4 prompts in one request, more than the limit of 3")
        assert "--max-prompts-per-request 3" in resp.json()["error"]["message"]
        resp = client.post(COMPLETIONS, json={"prompt": [[1, 2]] * 3, "max_tokens": 1})
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 3
        many_stops = {"prompt": "Hi", "stop": [f"s{i}" for i in range(100)], "max_tokens": 1}
        assert client.post(COMPLETIONS, json=many_stops).status_code == 200  # 0: no limit
        three = {"messages": [{"role": "user", "content": "hi"}] * 3}
        assert_error(client.post(TOKENIZE, json=three), 400, "--max-messages 2")
    finally:
        client.close()


def test_unlimited_checks_nothing() -> None:
    from model_server.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}] * 10_000, stop=["x" * 10_000] * 100
    )
    RequestLimits().check_chat(request)  # every limit 0: nothing raises
    with pytest.raises(Exception, match="--max-messages 9999"):
        RequestLimits(max_messages=9999).check_chat(request)


def test_size_and_waiting_settings_parse() -> None:
    assert parse_byte_count("32MiB") == 32 << 20 and parse_byte_count("100") == 100
    assert ServerSettings(max_request_body_size="512KiB").max_request_body_size == 512 << 10
    assert ServerSettings().max_waiting_requests is None  # auto
    assert ServerSettings(max_waiting_requests="auto").max_waiting_requests is None
    assert resolve_max_waiting_requests(None, 256) == 1024
    assert resolve_max_waiting_requests(0, 256) == 0  # no limit, as asked
    with pytest.raises(ValueError, match="auto or a count"):
        ServerSettings(max_waiting_requests="lots")


# -------------------------------------------------------------------------------- backpressure


@dataclass
class Gated:
    url: str
    llm: AsyncLLM
    engine: FakeEngine


@pytest.fixture
def gated(tiny_config: Path, request: pytest.FixtureRequest) -> Iterator[Gated]:
    """The app over a fake engine that takes no step until the test releases `step_gate`, on a
    loopback port; settings from the test's indirect parameter."""
    engines: list[FakeEngine] = []

    def factory(config: Any) -> FakeEngine:
        engine = FakeEngine(config)
        engine.step_gate = threading.Semaphore(0)
        engines.append(engine)
        return engine

    settings = tiny_settings(tiny_config, **request.param)
    llm = AsyncLLM(settings.engine_config(), engine_factory=factory, skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        try:
            yield Gated(url, llm, engines[0])
        finally:
            engines[0].step_gate.release(100_000)


def with_settings(**settings: Any) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("gated", [settings], indirect=True, ids=[""])


def completion(url: str, num_prompts: int) -> httpx.Response:
    body = {"prompt": [[1, 2, 3]] * num_prompts, "max_tokens": 2}
    return httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=60)


def in_background(pool: ThreadPoolExecutor, url: str, num_prompts: int) -> Future[httpx.Response]:
    return pool.submit(completion, url, num_prompts)


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@with_settings(max_waiting_requests=4)
def test_a_multi_prompt_request_is_admitted_whole_or_gets_503(gated: Gated) -> None:
    llm, engine = gated.llm, gated.engine
    with ThreadPoolExecutor(4) as pool:
        first = in_background(pool, gated.url, 2)  # two engine requests wait (no step runs)
        wait_for(lambda: llm.num_waiting_requests == 2)
        most_unfinished = watch(lambda: llm.num_unfinished_requests)
        started_at = time.monotonic()
        refused = completion(gated.url, 3)  # 2 + 3 > 4
        assert time.monotonic() - started_at < ANSWER_WITHIN_S
        assert most_unfinished() == 2  # not one of its prompts was added, even for a moment
        error = assert_error(refused, 503, "2 requests are already waiting and this request adds 3")
        assert "--max-waiting-requests 4" in error["message"] and error["code"] == "overloaded"
        assert refused.headers["retry-after"] == "1"
        assert llm.num_unfinished_requests == llm.num_waiting_requests == 2
        fits = in_background(pool, gated.url, 2)  # 2 + 2 = 4: admitted whole
        wait_for(lambda: llm.num_waiting_requests == 4)
        engine.step_gate.release(100_000)
        assert first.result(30).status_code == 200
        answer = fits.result(30)
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in answer.json()["choices"])


@with_settings(max_waiting_requests=4)
def test_more_prompts_than_the_queue_could_hold_is_400_not_503(gated: Gated) -> None:
    resp = completion(gated.url, 5)
    error = assert_error(resp, 400, "5 engine requests (one per prompt), more than the 4")
    assert "--max-waiting-requests 4" in error["message"]
    assert gated.llm.num_unfinished_requests == 0 and not gated.engine.requests


@with_settings(max_num_seqs=2)
def test_the_default_limit_is_four_batches_of_max_num_seqs(gated: Gated) -> None:
    llm = gated.llm
    assert llm.max_waiting_requests == 8  # auto: 4 x --max-num-seqs 2
    assert_error(completion(gated.url, 9), 400, "--max-waiting-requests 8")
    with ThreadPoolExecutor(2) as pool:
        full = in_background(pool, gated.url, 8)
        wait_for(lambda: llm.num_waiting_requests == 8)
        assert_error(completion(gated.url, 1), 503, "8 requests are already waiting")
        gated.engine.step_gate.release(100_000)
        assert full.result(30).status_code == 200


def test_admitted_slots_count_as_waiting_until_their_requests_are_added() -> None:
    """Between `admit` and the prompts' `generate`, another request cannot take the slots; an
    admitted id is added even when the queue is full; `release` gives back the ones unused."""
    import asyncio

    async def main() -> None:
        llm, engine = await started()
        llm.max_waiting_requests = 3
        engine.step_gate = threading.Semaphore(0)
        admission = llm.admit(["a-0", "a-1"])
        assert llm.num_waiting_requests == 2
        b = asyncio.ensure_future(collect(llm, "b"))  # 2 + 1 = 3: fits
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError, match="3 requests are already waiting"):
            await collect(llm, "c")
        with pytest.raises(ValueError, match="already in use"):
            llm.admit(["a-1"])
        a0 = asyncio.ensure_future(collect(llm, "a-0"))  # admitted: no check of its own
        await asyncio.sleep(0.05)
        assert llm.num_unfinished_requests == 2 and llm.num_waiting_requests == 3  # a-1 held
        llm.release(admission)  # a-1 never came
        assert llm.num_waiting_requests == 2
        again = llm.admit(["a-1"])  # the id is free again; a stale release leaves it be
        llm.release(admission)
        assert llm.num_waiting_requests == 3
        llm.release(again)
        engine.step_gate.release(100_000)
        assert len(await a0) == len(await b) == 4
        await llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_streamed_multi_prompt_request_is_admitted_the_same_way(tiny_config: Path) -> None:
    settings = tiny_settings(tiny_config, max_waiting_requests=2)
    llm = AsyncLLM(settings.engine_config(), engine_factory=FakeEngine, skip_warmup=True)
    with serve_asgi(build_app(llm, settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 30)
        body = {"prompt": [[1, 2]] * 3, "max_tokens": 2, "stream": True}
        resp = httpx.post(f"{url}{COMPLETIONS}", json=body, timeout=30)
        assert_error(resp, 400, "--max-waiting-requests 2")  # before any SSE byte
        body["prompt"] = [[1, 2]] * 2
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=30) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1}
