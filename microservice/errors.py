"""Errors answered to clients, and the upstream (model server) failures they come from.

Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}` plus FastAPI's
`{"detail": message}`, so both OpenAI clients and OPEA clients (which read `detail`) find it.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """An error answered with `status_code` and a message meant for the client."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _error_type(status_code)
        self.param = param
        self.code = code
        # Seconds (as sent) before a retry may succeed; answered as `Retry-After` when set.
        self.retry_after: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if self.retry_after else {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.type, self.param, self.code)


def _error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code < 500:
        return "invalid_request_error"
    return "server_error"


def error_body(
    message: str,
    status_code: int,
    type: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    error = {
        "message": message,
        "type": type or _error_type(status_code),
        "param": param,
        "code": code,
    }
    return {"error": error, "detail": message}


class UpstreamError(ServiceError):
    """The model server failed us. `kind` labels the upstream-errors metric."""

    kind = "protocol"


class UpstreamUnavailable(UpstreamError):
    """Could not connect (refused, DNS, connect timeout) or the model server is not ready."""

    kind = "connect"

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, code="model_server_unavailable")
        self.retry_after = "1"  # it may be restarting, or behind a load balancer


class UpstreamTimeout(UpstreamError):
    """No bytes from the model server within the read timeout."""

    kind = "timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, 504, code="model_server_timeout")


class UpstreamBroken(UpstreamError):
    """The connection broke or the model server answered something unreadable."""

    kind = "protocol"

    def __init__(self, message: str) -> None:
        super().__init__(message, 502, code="bad_gateway")


class UpstreamStreamError(UpstreamError):
    """The model server reported an error event in the middle of a stream."""

    kind = "stream"

    def __init__(self, message: str, code: str | int | None = None) -> None:
        super().__init__(message, 502, code=code)


class UpstreamHTTPError(UpstreamError):
    """A non-200 answer from the model server: 4xx pass through with their message (they are
    the client's fault), 5xx become 502/503/504."""

    def __init__(
        self,
        message: str,
        status_code: int,
        *,
        upstream_status: int,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message, status_code, type=type, param=param, code=code)
        self.upstream_status = upstream_status
        self.kind = "http_4xx" if upstream_status < 500 else "http_5xx"


# Every `kind` above, so the metric's series exist (at 0) before the first failure.
UPSTREAM_ERROR_KINDS = ("connect", "timeout", "protocol", "stream", "http_4xx", "http_5xx")
