"""GET / answers the static chat page (the browser test is tests/e2e/test_chat_page.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.entrypoints.conftest import AppClient, start_app, tiny_settings


def test_root_is_the_chat_page_and_it_references_nothing_elsewhere(api: AppClient) -> None:
    resp = api.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page = resp.text
    assert "<title>Wick chat</title>" in page and "/v1/chat/completions" in page
    # No CDN, no web font, no remote anything: it must work offline.
    assert re.findall(r"(?:https?:)?//[\w.-]+\.\w", page) == []
    assert re.findall(r"<(?:script|link|img)[^>]+(?:src|href)=", page) == []
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp


def test_the_page_is_open_without_the_api_key_the_api_is_not(tiny_config: Path) -> None:
    client = start_app(tiny_settings(tiny_config, api_key="sekret"))
    try:
        assert client.get("/").status_code == 200
        assert client.get("/v1/models").status_code == 401
    finally:
        client.close()
