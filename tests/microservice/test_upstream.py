"""The model-server client: SSE parsing, error mapping, streams that close when abandoned."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from microservice.errors import (
    UpstreamBroken,
    UpstreamHTTPError,
    UpstreamStreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from microservice.upstream import (
    DONE,
    ModelServer,
    Piece,
    chunk_piece,
    default_limit,
    error_from_response,
    map_transport_error,
    parse_sse_line,
    stream_chat,
)
from tests.microservice.conftest import run
from tests.microservice.fakes import BrokenStream, HangingStream, sse_body

URL = "http://ms:8008"


def test_sse_lines() -> None:
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line("event: message") is None
    assert parse_sse_line('data:{"choices": []}') == {"choices": []}
    with pytest.raises(UpstreamStreamError, match="engine died"):
        parse_sse_line('data: {"error": {"message": "engine died", "code": 500}}')
    with pytest.raises(UpstreamBroken, match="unreadable"):
        parse_sse_line("data: {not json")


def test_chunk_pieces() -> None:
    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

    assert chunk_piece(chunk({"role": "assistant", "content": ""})) is None
    assert chunk_piece(chunk({"content": "Hi"})) == Piece("Hi")
    assert chunk_piece(chunk({}, "length")) == Piece("", "length")
    assert chunk_piece({"choices": [], "usage": {}}) is None


def _body(message: str, **kw: object) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", **kw}}
    ).encode()


@pytest.mark.parametrize(
    ("upstream", "status", "kind"),
    [(400, 400, "http_4xx"), (404, 404, "http_4xx"), (413, 413, "http_4xx"),
     (401, 502, "http_4xx"), (403, 502, "http_4xx"), (500, 502, "http_5xx"),
     (503, 503, "http_5xx"), (504, 504, "http_5xx")],
)  # fmt: skip
def test_upstream_statuses(upstream: int, status: int, kind: str) -> None:
    err = error_from_response(upstream, _body("too long", param="messages", code="ctx"))
    assert isinstance(err, UpstreamHTTPError)
    assert (err.status_code, err.kind, err.upstream_status) == (status, kind, upstream)
    assert "too long" in err.message
    if upstream in (400, 404, 413):  # the client's fault: passed through as it is
        assert (err.message, err.param, err.code) == ("too long", "messages", "ctx")
    if upstream in (401, 403):  # our credentials, not the client's
        assert "LLM_API_KEY" in err.message


def test_unreadable_error_bodies_still_give_a_message() -> None:
    assert error_from_response(502, b"<html>bad gateway</html>").message.endswith(
        "<html>bad gateway</html>"
    )
    assert "HTTP 400" in error_from_response(400, b"").message
    assert error_from_response(422, b'{"detail": "field x"}').message == "field x"


@pytest.mark.parametrize(
    ("exc", "cls", "status"),
    [
        (httpx.ConnectError("refused"), UpstreamUnavailable, 503),
        (httpx.ConnectTimeout("slow connect"), UpstreamUnavailable, 503),
        (httpx.PoolTimeout("pool"), UpstreamUnavailable, 503),
        (httpx.ReadTimeout("slow"), UpstreamTimeout, 504),
        (httpx.RemoteProtocolError("peer closed"), UpstreamBroken, 502),
        (httpx.ReadError("reset"), UpstreamBroken, 502),
    ],
)
def test_transport_errors(exc: httpx.HTTPError, cls: type, status: int) -> None:
    err = map_transport_error(exc, URL)
    assert isinstance(err, cls) and err.status_code == status and URL in err.message


def _collect(transport: httpx.MockTransport) -> list[Piece]:
    async def go() -> list[Piece]:
        async with httpx.AsyncClient(base_url=URL, transport=transport) as client:
            return [p async for p in stream_chat(client, {"stream": True}, URL)]

    return run(go())


def test_stream_pieces_until_done() -> None:
    body = sse_body(["Hel", "lo"], finish_reason="length")
    pieces = _collect(httpx.MockTransport(lambda r: httpx.Response(200, content=body)))
    assert pieces == [Piece("Hel"), Piece("lo"), Piece("", "length")]


HEAD = sse_body(["a"], done=False)
FAILURES = {
    "connection-breaks": (lambda: httpx.Response(200, stream=BrokenStream(HEAD)), UpstreamBroken),
    "no-done": (lambda: httpx.Response(200, content=HEAD), UpstreamBroken),
    "error-event": (
        lambda: httpx.Response(200, content=b'data: {"error": {"message": "x"}}\n\n'),
        UpstreamStreamError,
    ),
    "http-400": (lambda: httpx.Response(400, content=_body("too long")), UpstreamHTTPError),
}


@pytest.mark.parametrize(("response", "error"), FAILURES.values(), ids=FAILURES.keys())
def test_stream_failures_raise_upstream_errors(response: object, error: type) -> None:
    transport = httpx.MockTransport(lambda r: response())  # type: ignore[operator]
    with pytest.raises(error):
        _collect(transport)


def test_stream_transport_failure_is_503() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(UpstreamUnavailable):
        _collect(httpx.MockTransport(refuse))


def test_cancelled_stream_closes_the_upstream_response_despite_repeated_cancels() -> None:
    """Starlette (anyio) cancels a disconnected stream's task again and again; the upstream
    response must still get closed, or the model server generates for nobody."""

    async def go() -> None:
        hanging = HangingStream(sse_body(["a"], done=False))
        transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=hanging))
        async with httpx.AsyncClient(base_url=URL, transport=transport) as client:

            async def consume() -> None:
                async for _ in stream_chat(client, {}, URL):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.wait_for(hanging.started.wait(), 5)
            for _ in range(20):
                task.cancel()
                await asyncio.sleep(0)
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.wait_for(hanging.closed.wait(), 5)

    run(go())


def test_model_discovery_is_asked_once_and_precedence() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json={"data": [{"id": "served"}]})

    async def go() -> list[str]:
        ms = ModelServer(URL, transport=httpx.MockTransport(handler))
        names = [await ms.resolve_model(None), await ms.resolve_model(None)]
        names.append(await ms.resolve_model("asked"))
        configured = ModelServer(URL, model_name="conf", transport=httpx.MockTransport(handler))
        names.append(await configured.resolve_model("asked"))
        return names

    assert run(go()) == ["served", "served", "asked", "conf"]
    assert calls == ["/v1/models"]


def test_api_key_is_sent_as_bearer() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    async def go() -> None:
        await ModelServer(URL, api_key="s3cret", transport=httpx.MockTransport(handler)).probe()

    run(go())
    assert seen == ["Bearer s3cret"] * 2  # /health, then /v1/models (checks the key works)


@pytest.mark.parametrize(
    ("default", "room", "sent"),
    [
        (1024, None, 1024),  # the model server cannot tell: OPEA's value as before
        (1024, 5000, 1024),
        (1024, 1024, 1024),
        (1024, 300, 300),  # was a 400 "maximum context length" for a limit nobody chose
        (1024, 1, 1),
        (1024, 0, None),  # no room at all: the model server's own "prompt too long" answers
        (1024, -7, None),
    ],
)
def test_default_limit_fits_the_room_the_prompt_leaves(
    default: int, room: int | None, sent: int | None
) -> None:
    assert default_limit(default, room) == sent


def test_completion_room_asks_tokenize_with_the_template_fields() -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 40, "max_model_len": 256, "tokens": []})

    messages = [{"role": "user", "content": "hi"}]
    params = {"top_k": 3, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}

    async def go() -> int | None:
        ms = ModelServer(URL, transport=httpx.MockTransport(handler))
        return await ms.completion_room("m", messages, params)

    assert run(go()) == 216
    assert bodies == [
        {
            "model": "m",
            "messages": messages,
            "add_generation_prompt": False,
            "chat_template_kwargs": {"x": 1},
        }
    ]


@pytest.mark.parametrize(
    ("status", "body", "asked_again"),
    [
        (404, {"detail": "Not Found"}, False),  # no /tokenize (not Wick or vLLM): never again
        (405, {"detail": "Method Not Allowed"}, False),
        (503, {"error": {"message": "loading"}}, True),  # the chat request will say so
        (400, {"error": {"message": "bad messages"}}, True),
        (200, {"count": 3}, True),  # no max_model_len in the answer
        (200, ["not", "an", "object"], True),
    ],
)
def test_completion_room_is_unknown_when_the_model_server_cannot_tell(
    status: int, body: object, asked_again: bool
) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(status, json=body)

    async def go() -> list[int | None]:
        ms = ModelServer(URL, transport=httpx.MockTransport(handler))
        return [await ms.completion_room("m", [], {}) for _ in range(2)]

    assert run(go()) == [None, None]
    assert len(calls) == (2 if asked_again else 1)


def test_completion_room_model_server_down_is_503() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> int | None:
        ms = ModelServer(URL, transport=httpx.MockTransport(handler))
        return await ms.completion_room("m", [], {})

    with pytest.raises(UpstreamUnavailable, match="unreachable"):
        run(go())
