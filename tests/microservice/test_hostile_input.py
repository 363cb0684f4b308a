"""Hostile input and a failing model server, over real HTTP on loopback: the microservice (uvicorn,
as deployed) in front of a stand-in model server that records every request it gets. Each case
checks the status, a message naming what is wrong, that the answer comes within 5 s, and that an
ordinary chat request sent meanwhile is answered normally."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from microservice.__main__ import FLAGS, load_settings
from microservice.app import build_app
from microservice.connectors import make_connector
from microservice.errors import ServiceError
from microservice.limits import DEFAULT_LIMITS, RequestLimits, parse_size
from microservice.protocol import parse_chat_request
from microservice.safe_json import MAX_DEPTH
from microservice.settings import MicroserviceSettings
from tests.loopback import free_port, serve_asgi

CHAT = "/v1/chat/completions"
MODEL = "stand-in"
MiB = 1 << 20
DEADLINE_S = 5.0
ORDINARY = {"messages": [{"role": "user", "content": "hello"}], "stream": False}
# Every upstream failure the stand-in plays, by the user message that asks for it.
GARBAGE, FAIL, HANG, DEEP, SURROGATE = "garbage", "fail", "hang", "deep", "surrogate"


# ------------------------------------------------------------------------ the stand-in upstream


@dataclass
class StandIn:
    """An OpenAI-style model server answering "you said: <last user message>", except for the
    messages above. It refuses (500) a body that is not strict UTF-8 JSON free of lone
    surrogates, as a real server may, so such a body cannot pass unnoticed."""

    seen: list[tuple[str, str | None, bytes]] = field(default_factory=list)

    def request_ids(self) -> set[str | None]:
        return {request_id for _, request_id, _ in self.seen}

    def bodies_of(self, request_id: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for _, rid, raw in self.seen if rid == request_id and raw]

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            self.seen.append((request.url.path, request.headers.get("x-request-id"), b""))
            return JSONResponse({"object": "list", "data": [{"id": MODEL}]})

        async def chat(request: Request) -> Response:
            raw = await request.body()
            self.seen.append((request.url.path, request.headers.get("x-request-id"), raw))
            try:
                body = json.loads(raw.decode("utf-8"))
                json.dumps(body, ensure_ascii=False).encode("utf-8")  # fails on lone surrogates
            except ValueError:
                return JSONResponse({"error": {"message": "unreadable request"}}, 500)
            user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
            return await _reply(user, bool(body.get("stream")))

        return Starlette(routes=[Route("/v1/models", models), Route(CHAT, chat, methods=["POST"])])


async def _reply(user: str, stream: bool) -> Response:
    if user == GARBAGE:
        return Response(b"<html>oops</html>", 200, media_type="text/html")
    if user == FAIL:
        return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
    if user == DEEP:
        return Response(b"[" * 100_000 + b"]" * 100_000, 200, media_type="application/json")
    if user == HANG:
        await asyncio.sleep(3)  # past the microservice's read timeout (1 s)
    text = "a<lone>b" if user == SURROGATE else f"you said: {user}"
    if stream:
        events = [{"delta": {"content": text}}, {"delta": {}, "finish_reason": "stop"}]
        lines = [f"data: {json.dumps({'choices': [{'index': 0, **e}]})}\n\n" for e in events]
        content, media_type = "".join(lines) + "data: [DONE]\n\n", "text/event-stream"
    else:
        message = {"role": "assistant", "content": text}
        content = json.dumps({"choices": [{"index": 0, "message": message}]})
        media_type = "application/json"
    # A lone surrogate as a server written in another language may send it: a JSON escape.
    return Response(content.replace("<lone>", "\\ud800"), 200, media_type=media_type)


@dataclass
class Stack:
    upstream: StandIn
    url: str  # the microservice, in front of the stand-in (read timeout 1 s)
    down_url: str  # a microservice whose model server is not listening


def _app(endpoint: str) -> Starlette:
    settings = MicroserviceSettings(model_server_endpoint=endpoint, read_timeout=1.0)
    return build_app(settings, make_connector(settings))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    upstream = StandIn()
    with (
        serve_asgi(upstream.app(), lifespan="off") as upstream_url,
        pytest.MonkeyPatch.context() as mp,
    ):
        for name in [n for n in os.environ if n.startswith("LLM_")]:
            mp.delenv(name)  # the developer's settings must not change the limits under test
        usvc, down = _app(upstream_url), _app(f"http://127.0.0.1:{free_port()}")
        with serve_asgi(usvc) as url, serve_asgi(down) as down_url:
            yield Stack(upstream, url, down_url)


# ------------------------------------------------------------------------ helpers


@dataclass
class Answer:
    status: int
    content: bytes
    seconds: float

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.content)

    @property
    def message(self) -> str:
        return str(self.body["error"]["message"])


def race(stack: Stack, hostile: Callable[[], Awaitable[tuple[int, bytes]]]) -> Answer:
    """Sends the hostile request and, while it is under way, an ordinary one, which must be
    answered normally; both within DEADLINE_S. The hostile request's answer."""

    async def timed_hostile() -> Answer:
        started = time.monotonic()
        status, content = await hostile()
        return Answer(status, content, time.monotonic() - started)

    async def ordinary() -> float:
        await asyncio.sleep(0.05)  # the hostile request is under way
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            response = await client.post(stack.url + CHAT, json=ORDINARY)
        assert response.status_code == 200, response.text
        assert response.json()["text"] == "you said: hello"
        return time.monotonic() - started

    async def both() -> Answer:
        answer, ordinary_s = await asyncio.gather(timed_hostile(), ordinary())
        assert ordinary_s < DEADLINE_S
        return answer

    answer = asyncio.run(asyncio.wait_for(both(), 60))
    assert answer.seconds < DEADLINE_S, answer
    return answer


def post(
    url: str, content: bytes | AsyncIterator[bytes], request_id: str = "hostile"
) -> Callable[[], Awaitable[tuple[int, bytes]]]:
    async def send() -> tuple[int, bytes]:
        headers = {"content-type": "application/json", "x-request-id": request_id}
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(url + CHAT, content=content, headers=headers)
        return response.status_code, response.content

    return send


def raw(url: str, head: bytes, parts: list[bytes]) -> Callable[[], Awaitable[tuple[int, bytes]]]:
    """Sends `head` and `parts` on a socket and reads the answer without sending anything more:
    the body is left unfinished, so an answer proves the server did not wait for the rest."""

    async def send() -> tuple[int, bytes]:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(head)
            for part in parts:
                writer.write(part)
                await writer.drain()
            return await asyncio.wait_for(_read_response(reader), DEADLINE_S)
        finally:
            writer.close()

    return send


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def head(*lines: str) -> bytes:
    return (
        "\r\n".join(["POST /v1/chat/completions HTTP/1.1", "Host: usvc", *lines]) + "\r\n\r\n"
    ).encode()


def names_limit(message: str, variable: str, flag: str, shown: str) -> None:
    assert variable in message and flag in message and shown in message, message


# ------------------------------------------------------------------------ the body's size


def test_a_64_mib_body_gets_413_naming_the_limit(stack: Stack) -> None:
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (64 * MiB) + b'"}]}'
    answer = race(stack, post(stack.url, body, "big-body"))
    assert answer.status == 413
    assert answer.body["error"]["code"] == "request_too_large"
    assert f"is {len(body)} bytes" in answer.message
    names_limit(
        answer.message, "LLM_USVC_MAX_REQUEST_BODY_SIZE", "--max-request-body-size", "16 MiB"
    )
    assert "big-body" not in stack.upstream.request_ids()


def test_a_declared_length_over_the_limit_is_answered_before_the_body_is_sent(stack: Stack) -> None:
    request = head("Content-Type: application/json", f"Content-Length: {64 * MiB}")
    answer = race(stack, raw(stack.url, request, [b'{"messages": [' * 100]))
    assert answer.status == 413
    names_limit(
        answer.message, "LLM_USVC_MAX_REQUEST_BODY_SIZE", "--max-request-body-size", "16 MiB"
    )


def test_expect_100_continue_gets_413_instead_of_continue(stack: Stack) -> None:
    # curl asks this way for bodies over 1 MB: refused, it never sends the body at all.
    request = head(f"Content-Length: {64 * MiB}", "Expect: 100-continue")
    answer = race(stack, raw(stack.url, request, []))
    assert answer.status == 413 and "LLM_USVC_MAX_REQUEST_BODY_SIZE" in answer.message


def test_a_chunked_body_is_refused_once_it_passes_the_limit(stack: Stack) -> None:
    chunk = b"x" * MiB
    parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 17  # 17 MiB, never terminated
    answer = race(stack, raw(stack.url, head("Transfer-Encoding: chunked"), parts))
    assert answer.status == 413
    assert "the request body is too large" in answer.message
    names_limit(
        answer.message, "LLM_USVC_MAX_REQUEST_BODY_SIZE", "--max-request-body-size", "16 MiB"
    )


def test_a_chunked_upload_over_the_limit_gets_413_at_the_client(stack: Stack) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(40):
            yield b" " * MiB

    answer = race(stack, post(stack.url, chunks(), "chunked-body"))
    assert answer.status == 413 and "LLM_USVC_MAX_REQUEST_BODY_SIZE" in answer.message
    assert "chunked-body" not in stack.upstream.request_ids()


# ------------------------------------------------------------------------ documents, messages


def rag_body(documents: list[str]) -> bytes:
    body = {"query": "What is it?", "documents": documents, "stream": False}
    return json.dumps(body, ensure_ascii=False).encode()


def test_100000_documents_get_400_and_never_reach_the_model_server(stack: Stack) -> None:
    answer = race(stack, post(stack.url, rag_body(["d"] * 100_000), "many-docs"))
    assert answer.status == 400
    assert answer.body["error"]["code"] == "too_many_documents"
    assert answer.body["error"]["param"] == "documents"
    assert "the request has 100000 documents" in answer.message
    names_limit(answer.message, "LLM_USVC_MAX_DOCUMENTS", "--max-documents", "1000")
    assert "many-docs" not in stack.upstream.request_ids()


def test_100_mb_of_documents_get_413_and_never_reach_the_model_server(stack: Stack) -> None:
    # The tester's case: 100,000 documents, 100 MB of text (was: no answer in 60 s).
    answer = race(stack, post(stack.url, rag_body(["w" * 1000] * 100_000), "huge-docs"))
    assert answer.status == 413
    assert "LLM_USVC_MAX_REQUEST_BODY_SIZE" in answer.message
    assert "huge-docs" not in stack.upstream.request_ids()


def test_documents_over_their_total_size_get_400(stack: Stack) -> None:
    # 9 MiB of UTF-8 (4.5M characters) in 9 documents: under the body's limit, over the
    # documents' 8 MiB.
    answer = race(stack, post(stack.url, rag_body(["é" * (MiB // 2)] * 9), "big-docs"))
    assert answer.status == 400
    assert answer.body["error"]["code"] == "documents_too_large"
    assert f"the documents hold {9 * MiB} bytes of text" in answer.message
    names_limit(answer.message, "LLM_USVC_MAX_DOCUMENTS_SIZE", "--max-documents-size", "8 MiB")
    assert "big-docs" not in stack.upstream.request_ids()


def test_documents_at_the_limits_are_served(stack: Stack) -> None:
    documents = ["d"] * DEFAULT_LIMITS.documents.value
    answer = race(stack, post(stack.url, rag_body(documents), "docs-at-limit"))
    assert answer.status == 200, answer.message
    [sent] = stack.upstream.bodies_of("docs-at-limit")
    assert "d\nd\nd" in sent["messages"][-1]["content"]


def test_too_many_messages_get_400(stack: Stack) -> None:
    messages = [{"role": "user", "content": "hi"}] * (DEFAULT_LIMITS.messages.value + 1)
    body = json.dumps({"messages": messages, "stream": False}).encode()
    answer = race(stack, post(stack.url, body, "many-messages"))
    assert answer.status == 400
    assert answer.body["error"]["code"] == "too_many_messages"
    names_limit(answer.message, "LLM_USVC_MAX_MESSAGES", "--max-messages", "1000")
    assert "many-messages" not in stack.upstream.request_ids()


# ------------------------------------------------------------------------ bodies that do not decode


def nested_kwargs(depth: int) -> bytes:
    """A chat request whose JSON nests `depth` levels: the body, chat_template_kwargs, lists."""
    lists = depth - 2
    kwargs = b'{"a": ' + b"[" * lists + b"]" * lists + b"}"
    return b'{"messages": [{"role": "user", "content": "hello"}], "stream": false, ' + (
        b'"chat_template_kwargs": ' + kwargs + b"}"
    )


DEEP_BODIES = {
    "array": b"[" * 100_000 + b"]" * 100_000,
    "in a request": b'{"messages": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
    "one past the limit": nested_kwargs(MAX_DEPTH + 1),
}


@pytest.mark.parametrize("body", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
def test_deep_nesting_gets_400(stack: Stack, body: bytes) -> None:
    answer = race(stack, post(stack.url, body, "deep-body"))
    assert answer.status == 400
    assert f"the request body nests JSON deeper than {MAX_DEPTH} levels" == answer.message
    assert "deep-body" not in stack.upstream.request_ids()


def test_nesting_at_the_limit_is_served(stack: Stack) -> None:
    answer = race(stack, post(stack.url, nested_kwargs(MAX_DEPTH), "deep-enough"))
    assert answer.status == 200, answer.content
    [sent] = stack.upstream.bodies_of("deep-enough")
    assert "chat_template_kwargs" in sent


UNDECODABLE = {
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    "an encoded surrogate": (b'{"messages": {"user": "\xed\xa0\x80"}}', "not valid UTF-8"),
    "invalid JSON": (b'{"messages": [', "not valid JSON"),
    "a huge integer": (b'{"messages": {"user": "u"}, "seed": ' + b"9" * 5000 + b"}", "digits"),
    "NaN": (b'{"messages": {"user": "u"}, "temperature": NaN}', "NaN is not a JSON number"),
    "a format spec": (
        json.dumps(
            {"query": "9" * 12, "documents": ["d"], "chat_template": "{context:>{question}}"}
        ).encode(),
        "chat_template: may use {context} and {question} only as they are",
    ),
}


@pytest.mark.parametrize(("body", "words"), UNDECODABLE.values(), ids=UNDECODABLE.keys())
def test_undecodable_bodies_get_a_4xx_naming_the_problem(
    stack: Stack, body: bytes, words: str
) -> None:
    answer = race(stack, post(stack.url, body, "undecodable"))
    assert answer.status in (400, 422)
    assert words in answer.message
    assert "undecodable" not in stack.upstream.request_ids()


LONE_SURROGATES = {
    "message": (
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "stream": false}',
        "a\ufffdb",
    ),
    "low half": (b'{"messages": {"user": "\\udc00x"}, "streaming": false}', "\ufffdx"),
    "document": (
        b'{"query": "q", "documents": ["half an emoji: \\ud83d"], "stream": false}',
        "half an emoji: \ufffd",
    ),
    "a pair stays": (b'{"messages": {"user": "\\ud83d\\ude00"}, "streaming": false}', "\U0001f600"),
}


@pytest.mark.parametrize(("body", "sent"), LONE_SURROGATES.values(), ids=LONE_SURROGATES.keys())
def test_lone_surrogates_reach_the_model_server_as_u_fffd(
    stack: Stack, body: bytes, sent: str
) -> None:
    request_id = f"surrogate-{len(stack.upstream.seen)}"
    answer = race(stack, post(stack.url, body, request_id))
    assert answer.status == 200, answer.message
    [received] = stack.upstream.bodies_of(request_id)
    assert sent in received["messages"][-1]["content"]


# ------------------------------------------------------------------------ the model server fails


def chat_body(user: str, stream: bool) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": user}], "stream": stream}).encode()


UPSTREAM_FAILURES = {
    "garbage": (GARBAGE, 502, "the model server sent an unexpected answer"),
    "HTTP 500": (FAIL, 502, "the model server failed (HTTP 500): boom"),
    "deep JSON": (DEEP, 502, "the model server sent an unexpected answer"),
    "too slow": (HANG, 504, "did not answer in time"),
}


@pytest.mark.parametrize(
    ("user", "status", "words"), UPSTREAM_FAILURES.values(), ids=UPSTREAM_FAILURES.keys()
)
def test_a_failing_model_server_gets_5xx_naming_it(
    stack: Stack, user: str, status: int, words: str
) -> None:
    answer = race(stack, post(stack.url, chat_body(user, stream=False)))
    assert answer.status == status
    assert words in answer.message


STREAM_FAILURES = {
    "garbage": (GARBAGE, 502, "the model server ended the stream without [DONE]"),
    "HTTP 500": (FAIL, 502, "the model server failed (HTTP 500): boom"),
    "deep JSON": (DEEP, 502, "the model server ended the stream without [DONE]"),
    "too slow": (HANG, 504, "did not answer in time"),
}


@pytest.mark.parametrize(
    ("user", "status", "words"), STREAM_FAILURES.values(), ids=STREAM_FAILURES.keys()
)
def test_a_failing_model_server_gets_5xx_before_a_stream_starts(
    stack: Stack, user: str, status: int, words: str
) -> None:
    answer = race(stack, post(stack.url, chat_body(user, stream=True)))
    assert answer.status == status
    assert words in answer.message


def test_a_model_server_that_is_down_gets_503(stack: Stack) -> None:
    answer = race(stack, post(stack.down_url, chat_body("hello", stream=False)))
    assert answer.status == 503
    assert answer.body["error"]["code"] == "model_server_unavailable"
    assert "is unreachable" in answer.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_from_the_model_server_is_answered_as_u_fffd(
    stack: Stack, stream: bool
) -> None:
    answer = race(stack, post(stack.url, chat_body(SURROGATE, stream)))
    assert answer.status == 200
    assert "a\ufffdb" in answer.content.decode("utf-8")


# ------------------------------------------------------------------------ the settings


@pytest.mark.parametrize(
    ("text", "size"),
    [("16MiB", 16 * MiB), ("512KiB", 512 << 10), ("2MB", 2_000_000), ("1.5 GiB", 3 << 29),
     ("1000", 1000), ("8m", 8 * MiB), ("100B", 100)],
)  # fmt: skip
def test_sizes_are_read_with_their_units(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_limits_come_from_the_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = MicroserviceSettings()
    assert (defaults.max_request_body_size, defaults.max_documents) == (16 * MiB, 1000)
    assert (defaults.max_documents_size, defaults.max_messages) == (8 * MiB, 1000)
    monkeypatch.setenv("LLM_USVC_MAX_REQUEST_BODY_SIZE", "1MiB")
    monkeypatch.setenv("LLM_USVC_MAX_DOCUMENTS", "7")
    monkeypatch.setenv("LLM_USVC_MAX_DOCUMENTS_SIZE", "64KiB")
    monkeypatch.setenv("LLM_USVC_MAX_MESSAGES", "9")
    s = load_settings(["--max-messages", "3"])
    assert (s.max_request_body_size, s.max_documents) == (MiB, 7)
    assert (s.max_documents_size, s.max_messages) == (64 << 10, 3)


@pytest.mark.parametrize("value", ["lots", "-1", "-1MiB", "16 furlongs", ""])
def test_a_bad_size_exits_2_naming_the_setting(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings([f"--max-request-body-size={value}"])
    assert info.value.code == 2
    assert "LLM_USVC_MAX_REQUEST_BODY_SIZE" in capsys.readouterr().err


def test_messages_name_the_real_flags_and_variables() -> None:
    by_env = {env: flag for flag, (_, env, _) in FLAGS.items()}
    limits = DEFAULT_LIMITS
    for limit in (limits.body_size, limits.documents, limits.documents_size, limits.messages):
        assert by_env[limit.variable] == limit.flag


def test_zero_means_no_limit() -> None:
    body = json.dumps(
        {"query": "q", "documents": ["d"] * 5000, "messages": [ORDINARY["messages"][0]] * 5000}
    )
    with pytest.raises(ServiceError) as info:
        parse_chat_request(body.encode())
    assert info.value.status_code == 400
    unlimited = RequestLimits.from_values(documents=0, documents_size=0, messages=0)
    chat = parse_chat_request(body.encode(), unlimited)
    assert len(chat.document_texts()) == 5000 and len(chat.chat_messages()) == 5000
