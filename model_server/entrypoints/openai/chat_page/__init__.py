"""The chat page at the model server's `/`: one static HTML file (index.html, next to this
module) with its CSS and JavaScript inline, streaming from /v1/chat/completions. No build step
and nothing fetched from elsewhere, so it works offline; the Content-Security-Policy header
makes the browser hold it to that."""

from __future__ import annotations

import functools
from importlib.resources import files

from fastapi import FastAPI
from starlette.responses import HTMLResponse

# Inline script and style only; requests to this server only.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)


@functools.cache
def page() -> str:
    return files(__package__).joinpath("index.html").read_text(encoding="utf-8")


def mount_chat_page(app: FastAPI) -> None:
    """GET / answers the chat page."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(
            page(),
            headers={
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "Cache-Control": "no-cache",
            },
        )
