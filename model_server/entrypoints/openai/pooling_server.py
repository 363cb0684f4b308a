"""The model server for a pooling model (embeddings, cross-encoder scores).

`run_server` hands over here when `--model` is a pooling model (pooling/config.py says which):
the same port, probes, API key, request ids, error shape and graceful drain as the generative
server, over the `AsyncPoolingEngine` instead of `AsyncLLM`. The generation routes answer 400
saying what this model serves (and the generative server does the same for these routes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response

from model_server.engine.pooling.async_engine import AsyncPoolingEngine
from model_server.engine.pooling.config import PoolingTask
from model_server.entrypoints.openai.api_server import (
    APIKeyMiddleware,
    _add_error_handlers,
    _GracefulServer,
    engine_app,
    model_root,
)
from model_server.entrypoints.openai.pooling_protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
)
from model_server.entrypoints.openai.protocol import APIError
from model_server.entrypoints.openai.request_id import RequestIdMiddleware
from model_server.entrypoints.openai.request_limits import BodySizeLimitMiddleware
from model_server.entrypoints.openai.serving_engine import json_response
from model_server.entrypoints.openai.serving_models import OpenAIServingModels
from model_server.entrypoints.openai.serving_pooling import (
    GENERATION_PATHS,
    OpenAIServingPooling,
)
from model_server.entrypoints.utils import ClientDisconnected, cancel_on_disconnect
from model_server.settings import ServerSettings

logger = logging.getLogger(__name__)

# What /v1/models says each kind of model serves.
CAPABILITIES = {
    PoolingTask.EMBED: ["embed", "score", "rerank"],  # scores: cosine similarity
    PoolingTask.SCORE: ["score", "rerank"],
}


class PoolingMetrics:
    """Prometheus metrics of a pooling server, in a registry of its own (vLLM's names where
    vLLM has one)."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens pooled.", list(labels), registry=self.registry
        ).labels(**labels)
        self.inputs = Counter(
            "wick:pooling_inputs", "Inputs pooled (texts or pairs).", list(labels),
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.step_seconds = Histogram(
            "wick:pooling_step_seconds", "Time of one pooling engine step.", list(labels),
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.requests = Counter(
            "wick:pooling_requests", "HTTP requests answered by the pooling endpoints.",
            ["model_name", "endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Inputs queued in the pooling engine, not run yet.",
            list(labels), registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.model_name = model_name

    def on_step(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        self.inputs.inc(num_inputs)
        self.prompt_tokens.inc(num_tokens)
        self.step_seconds.observe(seconds)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# Server settings for generation only (sampling defaults, chat parsing, generation limits):
# refused for a pooling model unless left at their defaults, rather than ignored.
GENERATION_SETTINGS = (
    "tool_call_parser", "reasoning_parser", "generation_config", "temperature", "top_p", "top_k",
    "repetition_penalty", "repeat_last_n", "max_tokens", "max_waiting_requests",
    "max_prompts_per_request", "max_stop_strings", "max_stop_string_length", "max_tools",
    "max_messages", "quantization_param_path",
)  # fmt: skip


def check_pooling_settings(settings: ServerSettings) -> None:
    """ValueError naming the first generation-only setting given for a pooling model."""
    for name in GENERATION_SETTINGS:
        field = ServerSettings.model_fields.get(name)
        if field is not None and getattr(settings, name) != field.default:
            raise ValueError(
                f"--{name.replace('_', '-')} is a text-generation setting; this model is a "
                "pooling model (embeddings / scores): drop it"
            )


def build_pooling_app(engine: AsyncPoolingEngine, settings: ServerSettings) -> FastAPI:
    app = engine_app(
        engine,
        settings,
        "Wick model server (pooling)",
        "Embeddings, reranking and scores over the Wick pooling engine.",
    )
    served = OpenAIServingModels(settings.model_names, settings.accept_any_model_name)
    serving = OpenAIServingPooling(engine, served)
    metrics = PoolingMetrics(served.model_name)
    engine.step_listeners.append(metrics.on_step)
    metrics.waiting.set_function(lambda: engine.num_waiting_requests)
    app.state.metrics = metrics
    root = model_root(settings)

    @app.get("/metrics", response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=None)
    async def models() -> Response:
        pooler = engine.pooler
        cards = [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "wick",
                "root": root,
                "max_model_len": engine.max_model_len,
                # Wick's addition: what the model serves (None while it loads).
                "capabilities": CAPABILITIES[pooler.task] if pooler else None,
                "pooling": pooler.pooling_type.value if pooler else None,
            }
            for name in served.served_model_names
        ]
        return json_response({"object": "list", "data": cards})

    async def answer(endpoint: str, work: Any, raw_request: Request) -> Response:
        """`work`'s body as JSON; a client that leaves first cancels it (its inputs still
        queued are dropped) and is logged as nginx's 499."""
        try:
            body = await cancel_on_disconnect(work, raw_request)
        except APIError as exc:
            metrics.requests.labels(metrics.model_name, endpoint, str(exc.status_code)).inc()
            raise
        except ClientDisconnected:
            metrics.requests.labels(metrics.model_name, endpoint, "499").inc()
            raise
        metrics.requests.labels(metrics.model_name, endpoint, "200").inc()
        return json_response(body)  # type: ignore[arg-type]

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await answer("/v1/embeddings", serving.create_embedding(request), raw_request)

    @app.post("/embed", response_model=None)
    async def tei_embed(request: TEIEmbedRequest, raw_request: Request) -> Response:
        return await answer("/embed", serving.tei_embed(request), raw_request)

    @app.post("/rerank", response_model=None)
    async def tei_rerank(request: TEIRerankRequest, raw_request: Request) -> Response:
        return await answer("/rerank", serving.tei_rerank(request), raw_request)

    @app.post("/v1/rerank", response_model=None)
    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await answer("/v1/rerank", serving.rerank(request), raw_request)

    @app.post("/v1/score", response_model=None)
    async def score(request: ScoreRequest, raw_request: Request) -> Response:
        return await answer("/v1/score", serving.score(request), raw_request)

    async def refuse_generation(request: Request) -> Response:
        raise APIError(
            f"{request.url.path}: {served.model_name} is a pooling model and generates no text; "
            "it serves /v1/embeddings, /embed, /v1/rerank, /rerank and /v1/score (see "
            "/v1/models)",
            400,
            param="model",
            code="wrong_model_task",
        )

    for path in GENERATION_PATHS:
        app.add_api_route(path, refuse_generation, methods=["POST"], response_model=None)
    _add_error_handlers(app)
    if settings.max_request_body_size:
        app.add_middleware(BodySizeLimitMiddleware, max_size=settings.max_request_body_size)
    if settings.api_key_value:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key_value)
    app.add_middleware(RequestIdMiddleware, log=settings.access_log)
    return app


def run_pooling_server(settings: ServerSettings, notes: Sequence[str] = ()) -> int:
    """Serve a pooling model until SIGTERM/SIGINT (0) or an engine failure (1)."""
    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    for note in notes:
        logger.info("%s", note)
    check_pooling_settings(settings)
    engine = AsyncPoolingEngine(settings.engine_config())
    app = build_pooling_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.drain_timeout,
    )
    server = _GracefulServer(
        config,
        on_signal=engine.begin_shutdown,
        busy=lambda: engine.num_unfinished_requests > 0,
        drain_timeout=settings.drain_timeout,
    )
    app.state.on_engine_failed = server.fail

    logger.info("serving pooling model %s on http://%s:%d", settings.model_name, settings.host,
                settings.port)  # fmt: skip
    server.run()
    return server.exit_code
