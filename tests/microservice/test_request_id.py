"""Request ids end to end and the model server's backpressure passed on (microservice side,
in-process with the model server faked; the real pair is in tests/e2e/test_microservice.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.microservice.conftest import run
from tests.microservice.fakes import CONNECTORS, FakeModelServer, make_client

pytestmark = pytest.mark.parametrize("connector", CONNECTORS)

CHAT = "/v1/chat/completions"
OPENAI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


def post(
    connector: str, fake: FakeModelServer, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        async with make_client(connector, fake) as client:
            return await client.post(CHAT, json=body, headers=headers or {})

    return run(go())


def upstream_ids(fake: FakeModelServer, path: str = CHAT) -> list[str | None]:
    return [r.headers.get("x-request-id") for r in fake.requests if r.url.path == path]


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_request_id_reaches_the_model_server_and_comes_back(
    connector: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeModelServer()
    with caplog.at_level(logging.INFO, logger="microservice.requests"):
        resp = post(connector, fake, {**OPENAI, "stream": stream}, {"X-Request-Id": "trace-42"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "trace-42"
    assert upstream_ids(fake) == ["trace-42"]
    if not stream:
        assert resp.json()["id"] == "chatcmpl-trace-42"
    assert any("request trace-42: POST /v1/chat/completions -> 200" in r.message
               for r in caplog.records)  # fmt: skip


def test_a_request_without_an_id_gets_one_made_and_sent_upstream(connector: str) -> None:
    fake = FakeModelServer(max_model_len=4096)  # OPEA's default limit asks /tokenize first
    body = {"messages": {"system": "Be brief.", "user": "Hi"}, "streaming": False}
    resp = post(connector, fake, body)
    assert resp.status_code == 200
    made = resp.headers["x-request-id"]
    assert len(made) == 32 and resp.json()["id"] == f"chatcmpl-{made}"
    # Every upstream call made for this request carries it, the chat and the token count.
    assert upstream_ids(fake) == [made] and upstream_ids(fake, "/tokenize") == [made]


def test_two_requests_get_different_ids(connector: str) -> None:
    fake = FakeModelServer()
    ids = {post(connector, fake, OPENAI).headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and set(upstream_ids(fake)) == ids


def test_a_malformed_request_id_is_400(connector: str) -> None:
    fake = FakeModelServer()
    resp = post(connector, fake, OPENAI, {"X-Request-Id": "has spaces in it"})
    assert resp.status_code == 400 and "X-Request-Id" in resp.json()["error"]["message"]
    assert fake.count(CHAT) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_model_servers_503_and_retry_after_are_passed_on(connector: str, stream: bool) -> None:
    message = "the server is overloaded: 4 requests are already waiting"

    def overloaded(request: httpx.Request, payload: dict[str, Any]) -> httpx.Response:
        error = {"message": message, "type": "server_error", "param": None, "code": "overloaded"}
        return httpx.Response(503, json={"error": error}, headers={"Retry-After": "1"})

    fake = FakeModelServer(chat=overloaded)
    resp = post(connector, fake, {**OPENAI, "stream": stream})
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert message in error["message"] and error["code"] == "overloaded"


def test_a_model_server_that_cannot_be_reached_is_503_with_retry_after(connector: str) -> None:
    async def go() -> httpx.Response:
        from microservice.app import build_app
        from microservice.connectors import make_connector
        from microservice.settings import MicroserviceSettings
        from tests.loopback import free_port

        settings = MicroserviceSettings(
            connector=connector, model_server_endpoint=f"http://127.0.0.1:{free_port()}"
        )
        app = build_app(settings, make_connector(settings))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://usvc") as client:
            return await client.post(CHAT, json={**OPENAI, "model": "m"})

    resp = run(go())
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert json.loads(resp.content)["error"]["code"] == "model_server_unavailable"


@pytest.mark.parametrize("role", ["user", "system"])
def test_a_message_without_content_is_422_before_the_model_server(
    connector: str, role: str
) -> None:
    fake = FakeModelServer()
    messages = [{"role": role}, {"role": "user", "content": "Hi"}][: 1 if role == "user" else 2]
    resp = post(connector, fake, {"messages": messages})
    assert resp.status_code == 422, resp.text  # the microservice's status for invalid fields
    assert f"a {role} message must have `content`" in resp.json()["error"]["message"]
    assert fake.count(CHAT) == 0
