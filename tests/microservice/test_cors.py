"""CORS on the microservice (LLM_USVC_ALLOWED_ORIGINS ...): the real app on a loopback port
over a faked model server, asked as a browser asks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from microservice.__main__ import load_settings
from microservice.app import build_app
from microservice.settings import MicroserviceSettings
from tests.loopback import serve_asgi
from tests.microservice.fakes import FakeModelServer, make_connector

PAGE = "http://chat.example:5173"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
OPEA = {"messages": {"user": "hi"}, "max_new_tokens": 4, "streaming": False}


@contextmanager
def served(**settings: Any) -> Iterator[httpx.Client]:
    s = MicroserviceSettings(**settings)
    app = build_app(s, make_connector("generic", FakeModelServer(), model_name=s.model_name))

    @app.get("/v1/boom")
    async def boom() -> None:  # an unhandled error: Starlette's ServerErrorMiddleware answers
        raise RuntimeError("boom")

    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_off_by_default() -> None:
    with served() as client:
        chat = "/v1/chat/completions"
        resp = client.options(chat, headers={"Origin": PAGE, **PREFLIGHT})
        assert "access-control-allow-origin" not in resp.headers
        resp = client.post(chat, json=OPEA, headers={"Origin": PAGE})
        assert resp.status_code == 200
        assert not [h for h in resp.headers if h.startswith("access-control-")]


def test_preflight_without_the_key_and_headers_on_answers_and_errors() -> None:
    with served(allowed_origins=PAGE, usvc_api_key="k3y") as client:
        chat = "/v1/chat/completions"
        pre = client.options(chat, headers={"Origin": PAGE, **PREFLIGHT})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == PAGE
        assert "POST" in pre.headers["access-control-allow-methods"]
        other = client.options(chat, headers={"Origin": "http://evil.example", **PREFLIGHT})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        key = {"Origin": PAGE, "Authorization": "Bearer k3y"}
        answers = {
            200: client.post(chat, json=OPEA, headers=key),
            401: client.post(chat, json=OPEA, headers={"Origin": PAGE}),
            400: client.post(
                chat, content=b"{", headers={**key, "content-type": "application/json"}
            ),
            500: client.get("/v1/boom", headers=key),
        }
        for status, resp in answers.items():
            assert resp.status_code == status, resp.text
            assert resp.headers.get("access-control-allow-origin") == PAGE, status


def test_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_USVC_ALLOWED_ORIGINS", '["http://a.example", "http://b.example"]')
    monkeypatch.setenv("LLM_USVC_ALLOW_CREDENTIALS", "true")
    s = load_settings(["--allowed-methods", "GET,POST"])
    assert s.cors is not None
    assert s.cors.allow_origins == ("http://a.example", "http://b.example")
    assert s.cors.allow_methods == ("GET", "POST")
    assert s.cors.allow_headers == ("*",)
    assert s.cors.allow_credentials is True
    s = load_settings(["--allowed-origins", "*", "--no-allow-credentials"])
    assert s.cors.allow_origins == ("*",) and s.cors.allow_credentials is False
    with pytest.raises(SystemExit):
        load_settings(["--allowed-origins", "http://a.example/"])  # a path: never matches
