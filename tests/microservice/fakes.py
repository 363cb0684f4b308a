"""A scripted model server behind httpx.MockTransport: records what the microservice sends and
answers with OpenAI-format bodies, SSE streams, errors or transport failures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from microservice.app import build_app
from microservice.connectors.base import Connector
from microservice.connectors.generic import GenericConnector
from microservice.connectors.langchain import LangchainConnector
from microservice.settings import MicroserviceSettings
from microservice.upstream import ModelServer

MODEL = "test-org/test-model"
CONNECTORS = ("generic", "langchain")


def sse_body(pieces: list[str], finish_reason: str = "stop", done: bool = True) -> bytes:
    """What the model server streams: a role chunk, one chunk per piece, a finish chunk."""

    def chunk(delta: dict[str, Any], reason: str | None = None) -> str:
        payload = {
            "id": "chatcmpl-up",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }
        return f"data: {json.dumps(payload)}\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": p}) for p in pieces]
    events.append(chunk({}, finish_reason))
    if done:
        events.append("data: [DONE]\n\n")
    return "".join(events).encode()


def completion_body(text: str, finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


class BrokenStream(httpx.AsyncByteStream):
    """Sends `head`, then the connection breaks (the model server died)."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


class HangingStream(httpx.AsyncByteStream):
    """Sends `head`, then nothing, forever; records being closed. Its close awaits, like a real
    socket's, so that a cancellation landing during the close would interrupt it."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.started = asyncio.Event()
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        self.started.set()
        await asyncio.Event().wait()
        yield b""  # never reached

    async def aclose(self) -> None:
        await asyncio.sleep(0.01)
        self.closed.set()


Reply = Callable[[httpx.Request, dict[str, Any]], httpx.Response]


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The fake's token count of a chat prompt: one per word plus 3 per message (template)."""
    return sum(len(str(m.get("content", "")).split()) + 3 for m in messages)


def context_error(payload: dict[str, Any], max_model_len: int) -> httpx.Response | None:
    """The model server's 400 when the prompt plus max_tokens exceed the context (Wick's
    messages); None when the request fits."""
    count = prompt_tokens(payload["messages"])
    max_tokens = payload.get("max_tokens")
    if max_tokens is None and count >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {count} tokens, which leaves no room for the completion."
        )
    elif max_tokens is not None and count + max_tokens > max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {count + max_tokens} tokens ({count} in the messages, {max_tokens} in "
            "the completion)."
        )
    else:
        return None
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return httpx.Response(400, json={"error": error})


@dataclass
class FakeModelServer:
    """`chat` answers /v1/chat/completions (default: "Hello" in two pieces); `health_status`
    is /health's status; with `api_key`, /v1/* answers 401 without that bearer key (/health
    stays open, as on Wick's model server); with `max_model_len`, /tokenize counts prompts
    (see `prompt_tokens`) and chats that do not fit get the model server's 400 (without it,
    /tokenize is a 404, as on servers that lack it); every request is recorded."""

    pieces: list[str] = field(default_factory=lambda: ["Hel", "lo"])
    health_status: int = 200
    chat: Reply | None = None
    api_key: str | None = None
    max_model_len: int | None = None
    requests: list[httpx.Request] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/health":
            body = {"status": "ok" if self.health_status == 200 else "unavailable"}
            body["phase"] = "ready" if self.health_status == 200 else "loading"
            return httpx.Response(self.health_status, json=body)
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": {"message": "invalid API key"}})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        if path == "/tokenize" and self.max_model_len is not None:
            count = prompt_tokens(json.loads(request.content)["messages"])
            body = {"count": count, "max_model_len": self.max_model_len, "tokens": [0] * count}
            return httpx.Response(200, json=body)
        if path == "/v1/chat/completions":
            payload = json.loads(request.content)
            if self.chat is not None:
                return self.chat(request, payload)
            if self.max_model_len is not None:
                too_long = context_error(payload, self.max_model_len)
                if too_long is not None:
                    return too_long
            if payload.get("stream"):
                return httpx.Response(
                    200,
                    content=sse_body(self.pieces),
                    headers={"content-type": "text/event-stream"},
                )
            return httpx.Response(200, json=completion_body("".join(self.pieces)))
        return httpx.Response(404, json={"error": {"message": "no such route"}})

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def count(self, path: str) -> int:
        return sum(1 for r in self.requests if r.url.path == path)


def make_connector(name: str, fake: FakeModelServer, **kw: Any) -> Connector:
    model_server = ModelServer(
        "http://model-server:8008", transport=httpx.MockTransport(fake.handler), **kw
    )
    if name == "langchain":
        return LangchainConnector(model_server)
    return GenericConnector(model_server)


def make_client(
    connector: str, fake: FakeModelServer, *, api_key: str | None = None, **settings: Any
) -> httpx.AsyncClient:
    """An httpx client calling the app in-process (ASGI), with its upstream faked."""
    s = MicroserviceSettings(connector=connector, **settings)
    app = build_app(s, make_connector(connector, fake, model_name=s.model_name, api_key=api_key))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://usvc")
