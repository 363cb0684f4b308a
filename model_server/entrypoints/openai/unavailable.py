"""503 answers that tell the client when to come back: `Retry-After` on every "not now" (loading,
overloaded past --max-waiting-requests, draining after SIGTERM)."""

from __future__ import annotations

from model_server.entrypoints.openai.protocol import APIError

# Seconds a client should wait before retrying. Short on purpose: an overloaded queue drains in
# about a step's time per request, and a draining replica is replaced by its load balancer.
RETRY_AFTER_S = 1


class ServiceUnavailable(APIError):
    """A 503 with `Retry-After`; with `close`, also `Connection: close`, so that a client on a
    kept-alive connection reconnects (to another replica) instead of reusing this one."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "service_unavailable",
        retry_after: int = RETRY_AFTER_S,
        close: bool = False,
    ) -> None:
        super().__init__(message, 503, code=code)
        self.headers = {"Retry-After": str(retry_after)}
        if close:
            self.headers["Connection"] = "close"
