"""Prometheus metrics on the service's own registry (so two apps in one process, as in tests,
never clash): requests by status, latency, time to first token, in-flight, upstream errors."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from microservice.errors import UPSTREAM_ERROR_KINDS

# Generation on CPUs takes seconds to minutes: buckets reach 10 minutes.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
PREFIX = "llm_microservice"


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Chat completion requests answered, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "Time from request to the last byte of the answer.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request to the first piece of text of a streamed answer.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "Chat completion requests being answered now.",
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors",
            "Failures of the model server, by kind.",
            ["kind"],
            registry=self.registry,
        )
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind=kind)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetricsMiddleware:
    """Counts, times and gauges the requests to `paths` (pure ASGI: streaming and disconnect
    detection pass through untouched). The request's start time is put in
    `scope["state"]["started"]` for the time-to-first-token measurement."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        scope.setdefault("state", {})["started"] = started
        status: dict[str, Any] = {"code": 500}

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.latency.observe(time.monotonic() - started)
            self.metrics.requests.labels(status=str(status["code"])).inc()
