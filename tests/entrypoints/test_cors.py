"""CORS (--allowed-origins ...): the real app with the tiny model on a loopback port, asked as a
browser asks (an Origin header; an OPTIONS preflight before a POST with JSON and a key)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_server.engine.async_engine import AsyncLLM
from model_server.entrypoints.openai.api_server import build_app
from tests.entrypoints.conftest import MODEL_NAME, tiny_settings
from tests.loopback import serve_asgi

PAGE = "http://chat.example:3000"
OTHER = "http://evil.example"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@contextmanager
def served(tiny_config: Path, **settings: Any) -> Iterator[httpx.Client]:
    s = tiny_settings(tiny_config, access_log=False, **settings)
    llm = AsyncLLM(s.engine_config(), skip_warmup=True)
    app = build_app(llm, s)

    @app.get("/v1/boom")
    async def boom() -> None:  # an unhandled error: Starlette's ServerErrorMiddleware answers
        raise RuntimeError("boom")

    with serve_asgi(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model server did not get ready"
            time.sleep(0.05)
        yield client


def preflight(client: httpx.Client, origin: str, path: str = "/v1/chat/completions") -> Any:
    return client.options(path, headers={"Origin": origin, **PREFLIGHT})


@pytest.fixture(scope="module")
def cors(tiny_config: Path) -> Iterator[httpx.Client]:
    with served(tiny_config, allowed_origins=PAGE, api_key="s3cret") as client:
        yield client


def test_off_by_default_no_cors_headers(tiny_config: Path) -> None:
    with served(tiny_config) as client:
        resp = preflight(client, PAGE)
        assert resp.status_code == 405  # no CORS layer: the route has no OPTIONS
        assert "access-control-allow-origin" not in resp.headers
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
        assert resp.status_code == 200
        assert not [h for h in resp.headers if h.startswith("access-control-")]


def test_preflight_from_an_allowed_origin_needs_no_api_key(cors: httpx.Client) -> None:
    resp = preflight(cors, PAGE)
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == PAGE
    assert "POST" in resp.headers["access-control-allow-methods"]
    assert resp.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in resp.headers  # off by default


def test_disallowed_origin_gets_no_cors_headers(cors: httpx.Client) -> None:
    resp = preflight(cors, OTHER)
    assert resp.status_code == 400
    assert "access-control-allow-origin" not in resp.headers
    resp = cors.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Origin": OTHER, "Authorization": "Bearer s3cret"},
    )
    assert resp.status_code == 200
    assert "access-control-allow-origin" not in resp.headers


def test_answers_and_errors_to_an_allowed_origin_carry_the_headers(cors: httpx.Client) -> None:
    key = {"Origin": PAGE, "Authorization": "Bearer s3cret"}
    ok = cors.post("/v1/chat/completions", json=CHAT, headers=key)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == PAGE
    # A page must be able to read the request id to quote it.
    assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
    answers = {
        401: cors.post("/v1/chat/completions", json=CHAT, headers={"Origin": PAGE}),
        400: cors.post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=key),
        404: cors.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=key),
        500: cors.get("/v1/boom", headers=key),
    }
    for status, resp in answers.items():
        assert resp.status_code == status, resp.text
        assert resp.headers.get("access-control-allow-origin") == PAGE, status


def test_credentials_methods_and_headers_settings(tiny_config: Path) -> None:
    with served(
        tiny_config,
        allowed_origins='["http://a.example", "http://b.example:8080"]',  # vLLM's JSON list
        allowed_methods="GET POST",
        allowed_headers="Content-Type",
        allow_credentials=True,
    ) as client:
        resp = preflight(client, "http://b.example:8080")
        assert resp.status_code == 400  # authorization is not an allowed header
        assert "Disallowed CORS headers" in resp.text
        resp = client.options(
            "/v1/models",
            headers={"Origin": "http://b.example:8080", "Access-Control-Request-Method": "GET"},
        )
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == "http://b.example:8080"
        assert resp.headers["access-control-allow-credentials"] == "true"
        assert resp.headers["access-control-allow-methods"] == "GET, POST"
        delete = client.options(
            "/v1/models",
            headers={"Origin": "http://a.example", "Access-Control-Request-Method": "DELETE"},
        )
        assert delete.status_code == 400


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "http://a/b"])
def test_an_origin_with_a_path_or_no_scheme_is_refused(origin: str) -> None:
    from pydantic import ValidationError

    from model_server.settings import ServerSettings

    with pytest.raises(ValidationError, match="is not an origin"):
        ServerSettings(allowed_origins=origin)


# ------------------------------------------------------------------------ a real browser

FETCH = """
const [url, key, done] = arguments;
fetch(url + "/v1/chat/completions", {
  method: "POST",
  headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
  body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2}),
}).then(r => r.json().then(b => done({status: r.status, id: r.headers.get("x-request-id"),
                                      object: b.object || null})))
  .catch(e => done({error: String(e)}));
"""


@pytest.mark.slow
def test_a_page_on_another_origin_calls_the_api_in_chromium(tiny_config: Path) -> None:
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from tests.browser import headless_chromium

    page = Starlette(routes=[Route("/", lambda _: HTMLResponse("<title>chat ui</title>"))])
    with serve_asgi(page) as page_url:
        driver = headless_chromium()
        try:
            driver.set_script_timeout(60)
            driver.get(page_url + "/")
            for origins, allowed in (("", False), (page_url, True)):
                with served(tiny_config, allowed_origins=origins or None, api_key="k") as api:
                    result = driver.execute_async_script(FETCH, str(api.base_url), "k")
                if allowed:  # preflight answered without the key, then the POST with it
                    assert result["status"] == 200, result
                    assert result["object"] == "chat.completion"
                    assert result["id"]  # exposed to the page
                else:  # the browser refuses to hand the page a response without CORS
                    assert "Failed to fetch" in result.get("error", ""), result
        finally:
            driver.quit()


def test_serve_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from model_server.entrypoints.cli import build_parser
    from model_server.entrypoints.openai.cli_args import settings_from_args
    from model_server.entrypoints.openai.cors import CORSPolicy

    def policy(*argv: str) -> CORSPolicy | None:
        return CORSPolicy.from_settings(settings_from_args(build_parser().parse_args(argv)))

    assert policy("serve") is None  # off by default
    got = policy(
        "serve", "--allowed-origins", "http://a:1", "http://b", "--allowed-headers",
        "Authorization,Content-Type", "--allow-credentials",
    )  # fmt: skip
    assert got == CORSPolicy(
        ("http://a:1", "http://b"), ("*",), ("Authorization", "Content-Type"), True
    )
    monkeypatch.setenv("LLM_ALLOWED_ORIGINS", '["http://x.example"]')
    monkeypatch.setenv("LLM_ALLOWED_METHODS", "GET, POST")
    got = policy("serve")
    assert got is not None and got.allow_origins == ("http://x.example",)
    assert got.allow_methods == ("GET", "POST") and got.allow_credentials is False
    assert policy("serve", "--allowed-origins", "*").allow_origins == ("*",)  # flag wins
