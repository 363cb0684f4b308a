"""CORS for the microservice (vLLM's --allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials; LLM_USVC_ALLOWED_ORIGINS, ...): off unless origins are given.

Starlette's CORSMiddleware wraps the whole app, outside even Starlette's ServerErrorMiddleware
(as a user middleware it would sit inside it, and the 500s it answers would reach a browser
without the CORS headers: a bare network error) and outside the API key check, so preflights,
which never carry credentials, are answered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

# scheme://host[:port], what a browser sends as Origin: no path, no trailing slash.
_ORIGIN_RE = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s]+$", re.IGNORECASE)


def parse_list(value: Any) -> list[str]:
    """vLLM's JSON list (`'["http://a"]'`), or items separated by commas or spaces."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    elif str(value).strip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list of strings: {value!r}: {exc}") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"not a JSON list of strings: {value!r}")
        items = parsed
    else:
        items = re.split(r"[,\s]+", str(value))
    return list(dict.fromkeys(v.strip() for v in items if v.strip()))


def check_origins(origins: list[str]) -> list[str]:
    for origin in origins:
        if origin != "*" and not _ORIGIN_RE.match(origin):
            raise ValueError(
                f"{origin!r} is not an origin: write scheme://host[:port] without a path or "
                "trailing slash (what browsers send), or *"
            )
    return origins


@dataclass(slots=True, frozen=True)
class CORSPolicy:
    allow_origins: tuple[str, ...]
    allow_methods: tuple[str, ...]
    allow_headers: tuple[str, ...]
    allow_credentials: bool

    def wrap(self, app: ASGIApp) -> ASGIApp:
        return CORSMiddleware(
            app,
            allow_origins=self.allow_origins,
            allow_methods=self.allow_methods or ("*",),
            allow_headers=self.allow_headers or ("*",),
            allow_credentials=self.allow_credentials,
            # Pages may read the id to quote it in a bug report, and when to retry a 503.
            expose_headers=("x-request-id", "retry-after"),
        )


class CORSApp(FastAPI):
    """FastAPI with `cors` (a CORSPolicy, or None) wrapped around its whole middleware stack."""

    cors: CORSPolicy | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return stack if self.cors is None else self.cors.wrap(stack)
