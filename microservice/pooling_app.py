"""The embedding (:6000) and reranking (:8000) microservices: OPEA's payloads in, the model
server's pooling API out over httpx (`/v1/embeddings`, TEI's `/rerank`), the LLM microservice's
siblings. Each has `GET /v1/health_check` (the model server's readiness, probed and cached) and
`GET /metrics`. Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.responses import JSONResponse, Response

from microservice import __version__, safe_json
from microservice.disconnect import CLIENT_CLOSED, ClientGone, until_disconnected
from microservice.errors import UPSTREAM_ERROR_KINDS, ServiceError, UpstreamBroken, UpstreamError
from microservice.health import CachedHealth
from microservice.metrics import RequestMetricsMiddleware
from microservice.pooling_protocol import (
    embed_doc,
    parse_embedding,
    parse_reranking,
    reranking_answer,
)
from microservice.pooling_settings import EmbeddingSettings, RerankingSettings
from microservice.request_id import RequestIdMiddleware
from microservice.upstream import ModelServer, error_from_response, map_transport_error

logger = logging.getLogger("microservice")

EMBEDDING_PATH = "/v1/embeddings"
RERANKING_PATH = "/v1/reranking"
# Embedding or reranking a request's documents takes milliseconds to seconds on CPUs.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

Handler = Callable[[Any, ModelServer], Awaitable[Any]]


class PoolingServiceMetrics:
    """The service's own registry: requests by status, latency, in-flight, upstream errors
    (the same shape as the LLM microservice's, under `<prefix>_`)."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{prefix}_requests", "Requests answered, by HTTP status.", ["status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            f"{prefix}_request_latency_seconds", "Time from request to answer.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            f"{prefix}_requests_in_flight", "Requests being answered now.", registry=self.registry
        )
        self.upstream_errors = Counter(
            f"{prefix}_upstream_errors", "Failures of the model server, by kind.", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.labels(kind=kind)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


async def post_json(server: ModelServer, path: str, body: dict[str, Any]) -> Any:
    """POST `body` to the model server; its JSON answer, or the UpstreamError it comes to."""
    try:
        response = await server.client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, server.base_url) from exc
    if response.status_code != 200:
        raise error_from_response(
            response.status_code, response.content, response.headers.get("retry-after")
        )
    try:
        return safe_json.loads(response.content)
    except ValueError:
        raise UpstreamBroken(
            f"the model server's {path} answered no JSON: {response.text[:200]!r}"
        ) from None


def _with_model(server: ModelServer, body: dict[str, Any]) -> dict[str, Any]:
    if server.configured_model:  # EMBEDDING_MODEL_NAME / RERANKING_MODEL_NAME win
        body["model"] = server.configured_model
    return body


async def handle_embedding(body: Any, server: ModelServer) -> Any:
    parsed = parse_embedding(body)
    if parsed.openai is not None:
        return await post_json(server, "/v1/embeddings", _with_model(server, parsed.openai))
    answer = await post_json(server, "/v1/embeddings", _with_model(server, {"input": parsed.texts}))
    try:
        rows = sorted(answer["data"], key=lambda d: d["index"])
        vectors = [list(map(float, row["embedding"])) for row in rows]
    except (KeyError, TypeError, ValueError):
        raise UpstreamBroken(f"unexpected /v1/embeddings answer: {str(answer)[:200]!r}") from None
    if len(vectors) != len(parsed.texts):
        raise UpstreamBroken(f"{len(vectors)} embeddings for {len(parsed.texts)} texts")
    return embed_doc(parsed, body["text"], vectors)


async def handle_reranking(body: Any, server: ModelServer) -> Any:
    parsed = parse_reranking(body)
    ranked: list[tuple[int, float]] = []
    if parsed.documents:
        answer = await post_json(
            server, "/rerank", {"query": parsed.query, "texts": parsed.documents}
        )
        try:
            ranked = sorted(
                ((int(r["index"]), float(r["score"])) for r in answer), key=lambda r: -r[1]
            )
        except (KeyError, TypeError, ValueError):
            raise UpstreamBroken(f"unexpected /rerank answer: {str(answer)[:200]!r}") from None
    return reranking_answer(parsed, ranked[: parsed.top_n])


def _build(
    *,
    title: str,
    description: str,
    path: str,
    handler: Handler,
    settings: EmbeddingSettings | RerankingSettings,
    metrics_prefix: str,
    transport: httpx.AsyncBaseTransport | None,
) -> FastAPI:
    server = ModelServer(
        settings.model_server_endpoint,
        api_key=settings.api_key_value,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        model_name=settings.model_name,
        transport=transport,
    )
    health = CachedHealth(server.probe, settings.health_cache_seconds)
    metrics = PoolingServiceMetrics(metrics_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await server.aclose()

    app = FastAPI(title=title, description=description, version=__version__, lifespan=lifespan)
    app.state.model_server = server
    app.state.metrics = metrics

    @app.post(path, response_model=None)
    async def serve(request: Request) -> Response:
        try:
            body = safe_json.loads(await request.body())
        except ValueError as exc:
            raise ServiceError(f"the body is not valid JSON: {exc}", 400) from None
        try:
            # A client that leaves cancels the model server call (which drops its inputs).
            return JSONResponse(await until_disconnected(handler(body, server), request))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @app.get("/v1/health_check", response_model=None)
    async def health_check() -> Response:
        """200 when the model server is ready, 503 when it is not (or unreachable)."""
        state = await health.get()
        body = {
            "Service Title": title,
            "Service Description": description,
            "version": __version__,
            "model_server": state,
        }
        return JSONResponse(body, status_code=200 if state["ready"] else 503)

    @app.get("/metrics", response_model=None)
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.exposition()
        return Response(content, headers={"Content-Type": content_type})

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> Response:
        if isinstance(exc, UpstreamError):
            metrics.upstream_errors.labels(kind=exc.kind).inc()
            logger.warning("%s: %s", path, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, paths=frozenset({path}))
    app.add_middleware(RequestIdMiddleware, paths=frozenset({path}))
    return app


def build_embedding_app(
    settings: EmbeddingSettings, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    return _build(
        title="opea_service@embedding",
        description="Wick embedding microservice: OPEA TextDoc / OpenAI embeddings over the "
        "Wick model server",
        path=EMBEDDING_PATH,
        handler=handle_embedding,
        settings=settings,
        metrics_prefix="embedding_microservice",
        transport=transport,
    )


def build_reranking_app(
    settings: RerankingSettings, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    return _build(
        title="opea_service@reranking",
        description="Wick reranking microservice: OPEA SearchedDoc / RerankingRequest over the "
        "Wick model server's cross-encoder",
        path=RERANKING_PATH,
        handler=handle_reranking,
        settings=settings,
        metrics_prefix="reranking_microservice",
        transport=transport,
    )
