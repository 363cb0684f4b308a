"""X-Request-Id on every API request: the client's (a gateway's, the microservice's) or a new
one, seen by the handlers as the request header (so it becomes the engine's request id,
`chatcmpl-<id>`), returned as a response header and logged with the status and duration."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_server.entrypoints.openai.protocol import APIError
from model_server.entrypoints.openai.serving_engine import json_response

logger = logging.getLogger("model_server.requests")

HEADER = "x-request-id"
# Printable ASCII without spaces, bounded: it goes into logs and the engine's request ids.
_VALID = re.compile(r"^[\x21-\x7e]{1,200}$")
# Probes and scrapes are not logged: they would drown the requests.
QUIET_PATHS = frozenset({"/health", "/metrics", "/version"})


class RequestIdMiddleware:
    """Pure ASGI (streaming and disconnect detection untouched). A malformed id is a 400."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        log: bool = True,
        on_response: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.log = log
        # Told (path, method, status) of every answer: the HTTP request counter.
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        if given is not None and not _VALID.match(given):
            error = APIError(
                "X-Request-Id must be 1-200 printable ASCII characters without spaces",
                400,
                param="X-Request-Id",
            )
            await json_response(error.to_response().model_dump(), 400)(scope, receive, send)
            return
        request_id = given or uuid.uuid4().hex
        if given is None:  # the handlers read the header: give them the one made here
            scope["headers"] = [*scope["headers"], (HEADER.encode(), request_id.encode())]
        scope.setdefault("state", {})["request_id"] = request_id
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
            if self.on_response is not None:
                self.on_response(scope["path"], scope["method"], status)
            if self.log and scope["path"] not in QUIET_PATHS:
                logger.info(
                    "request %s: %s %s -> %d in %.3fs",
                    request_id,
                    scope["method"],
                    scope["path"],
                    status,
                    time.monotonic() - started,
                )
