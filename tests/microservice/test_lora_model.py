"""The LLM microservice in front of a model server serving LoRA adapters (`--enable-lora
--lora-modules`): a request's `model` naming an adapter reaches the model server as it is (the
adapter is chosen by that name), in OpenAI's and OPEA's request forms, streamed or not, and an
adapter the model server does not serve is its 404, never another model's answer. Real HTTP on
loopback both ways: the microservice's app under uvicorn, a fake model server that lists its
adapters as Wick's /v1/models does (with `parent`) and records what it is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from microservice.app import build_app
from microservice.connectors import make_connector
from microservice.settings import MicroserviceSettings
from tests.fake_openai_server import FakeOpenAI, serve
from tests.loopback import serve_asgi

BASE = "base-model"
ADAPTERS = ("sql-lora", "chat-lora")


@dataclass
class LoRAModelServer(FakeOpenAI):
    """FakeOpenAI listing the base model and its adapters; a chat naming any other model gets
    Wick's 404 model_not_found (`rejected` lists the names)."""

    adapters: tuple[str, ...] = ADAPTERS
    rejected: list[str] = field(default_factory=list)

    def app(self) -> Any:
        inner = super().app()
        served = {self.model, *self.adapters}

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            path = scope.get("path")
            if scope["type"] == "http" and path == "/v1/models":
                data = [{"id": self.model, "object": "model", "parent": None}]
                data += [{"id": a, "object": "model", "parent": self.model} for a in self.adapters]
                await JSONResponse({"object": "list", "data": data})(scope, receive, send)
                return
            if scope["type"] != "http" or path != "/v1/chat/completions":
                await inner(scope, receive, send)
                return
            body, more = b"", True
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            model = json.loads(body).get("model")
            if model not in served:
                self.rejected.append(model)
                error = {
                    "message": f"The model `{model}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": "model_not_found",
                }
                await JSONResponse({"error": error}, 404)(scope, receive, send)
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            await inner(scope, replay, send)

        return app


@pytest.fixture(scope="module", params=["generic", "langchain"])
def stack(request: pytest.FixtureRequest) -> Iterator[tuple[LoRAModelServer, str]]:
    fake = LoRAModelServer(model=BASE)
    with serve(fake) as upstream:
        settings = MicroserviceSettings(model_server_endpoint=upstream, connector=request.param)
        with serve_asgi(build_app(settings, make_connector(settings))) as url:
            yield fake, url


def _chats(fake: LoRAModelServer) -> list[dict[str, Any]]:
    return [body for body in fake.requests if "messages" in body]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", [*ADAPTERS, BASE])
def test_the_requests_model_reaches_the_model_server(stack, model: str, stream: bool) -> None:
    fake, url = stack
    fake.requests.clear()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=30) as client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                assert any("you said: hi" in line or "said" in line for line in r.iter_lines())
        else:
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert "you said: hi" in resp.text
    assert [b["model"] for b in _chats(fake)] == [model]


def test_an_opea_request_naming_an_adapter_reaches_the_model_server(stack) -> None:
    fake, url = stack
    fake.requests.clear()
    body = {"messages": {"system": "Be brief.", "user": "hi"}, "model": "chat-lora",
            "max_tokens": 4, "stream": False}  # fmt: skip
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert [b["model"] for b in _chats(fake)] == ["chat-lora"]


def test_an_adapter_the_model_server_lacks_is_its_404(stack) -> None:
    fake, url = stack
    fake.requests.clear()
    fake.rejected.clear()
    body = {"model": "unloaded-lora", "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 404, resp.text
    assert "unloaded-lora" in resp.text
    # Several models served: no other one answers in its place.
    assert fake.rejected == ["unloaded-lora"] and _chats(fake) == []
