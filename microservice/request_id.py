"""X-Request-Id end to end: each request's id is the client's `X-Request-Id` or a new one; it is
returned as a response header, logged with the status and duration, and sent to the model server
on every upstream call made for the request (`forward_request_id`, an httpx request hook), where
it becomes the engine's request id (`chatcmpl-<id>`)."""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid

import httpx
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from microservice.errors import error_body

logger = logging.getLogger("microservice.requests")

HEADER = "x-request-id"
# Printable ASCII without spaces, bounded (the model server asks the same).
_VALID = re.compile(r"^[\x21-\x7e]{1,200}$")

# The id of the request being served (set by the middleware; tasks inherit it).
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str | None:
    return _current.get()


async def forward_request_id(request: httpx.Request) -> None:
    """httpx request hook: the served request's id on the upstream call."""
    request_id = _current.get()
    if request_id is not None and HEADER not in request.headers:
        request.headers[HEADER] = request_id


class RequestIdMiddleware:
    """Pure ASGI (streaming and disconnect detection untouched). `paths`: those logged (one
    line per request); every request gets the header back."""

    def __init__(self, app: ASGIApp, *, paths: frozenset[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        if given is not None and not _VALID.match(given):
            message = "X-Request-Id must be 1-200 printable ASCII characters without spaces"
            body = error_body(message, 400, param="X-Request-Id")
            await JSONResponse(body, status_code=400)(scope, receive, send)
            return
        request_id = given or uuid.uuid4().hex
        token = _current.set(request_id)
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            if scope["path"] in self.paths:
                logger.info(
                    "request %s: %s %s -> %d in %.3fs",
                    request_id,
                    scope["method"],
                    scope["path"],
                    status,
                    time.monotonic() - started,
                )
