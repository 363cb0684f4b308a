"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials).

Starlette's CORSMiddleware wraps the whole app, outside even Starlette's ServerErrorMiddleware:
as a user middleware it would sit inside it, and the 500s that middleware answers would reach a
browser without the CORS headers (which it reports as a network error, hiding the message).
Outside the API key check too, so preflights (which never carry credentials) are answered.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from model_server.entrypoints.openai.request_id import HEADER as REQUEST_ID_HEADER
from model_server.settings import ServerSettings
from model_server.settings_spec import split_list


@dataclass(slots=True, frozen=True)
class CORSPolicy:
    allow_origins: tuple[str, ...]
    allow_methods: tuple[str, ...]
    allow_headers: tuple[str, ...]
    allow_credentials: bool

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> CORSPolicy | None:
        """None (no CORS headers at all) unless origins are given."""
        origins = split_list(settings.allowed_origins)
        if not origins:
            return None
        return cls(
            tuple(origins),
            tuple(split_list(settings.allowed_methods) or ["*"]),
            tuple(split_list(settings.allowed_headers) or ["*"]),
            settings.allow_credentials,
        )

    def wrap(self, app: ASGIApp) -> ASGIApp:
        return CORSMiddleware(
            app,
            allow_origins=self.allow_origins,
            allow_methods=self.allow_methods,
            allow_headers=self.allow_headers,
            allow_credentials=self.allow_credentials,
            # Pages may read the id to quote it in a bug report, and when to retry a 503.
            expose_headers=(REQUEST_ID_HEADER, "retry-after"),
        )


class CORSApp(FastAPI):
    """FastAPI with `cors` (a CORSPolicy, or None) wrapped around its whole middleware stack."""

    cors: CORSPolicy | None = None

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        return stack if self.cors is None else self.cors.wrap(stack)
