"""Draining on SIGTERM: the port stays open while in-flight requests finish, and new ones get
503 with `Retry-After` and `Connection: close` (instead of a refused connection), so a client or
load balancer retries elsewhere. `Drain` is the shared state; the server (`__main__`) sets
`draining` on the signal and waits for `in_flight` to reach 0 before it closes the listener."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from microservice.errors import error_body

RETRY_AFTER_S = 1
# Scrapes keep working while draining: the last figures matter.
OPEN_WHILE_DRAINING = frozenset({"/metrics"})


@dataclass(slots=True)
class Drain:
    draining: bool = False
    in_flight: int = 0  # HTTP requests being answered (event loop only)


class DrainMiddleware:
    """Pure ASGI: counts requests in flight; while draining, answers new ones 503."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            message = "the service is shutting down: retry (another replica)"
            response = JSONResponse(
                error_body(message, 503, code="shutting_down"),
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
            )
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
