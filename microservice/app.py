"""The HTTP app: `build_app(settings, connector)`. Nothing happens at import time.

Routes: `POST /v1/chat/completions` (OPEA and OpenAI payloads), `GET /v1/health_check`,
`GET /metrics`. The service starts and answers whatever state the model server is in; a request
it cannot serve gets a quick 502/503/504, never a hang.

Invariant on disconnects: while the client waits (model resolution, a whole non-streamed answer,
a stream's first piece) a watcher listens for `http.disconnect` and cancels the upstream call;
once streaming, Starlette cancels the body iterator. Either way the connector's `async with`
closes the upstream response, so the model server aborts the request.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from microservice import __version__, formats
from microservice.connectors.base import Connector
from microservice.cors import CORSApp
from microservice.disconnect import CLIENT_CLOSED, ClientGone, until_disconnected
from microservice.drain import Drain, DrainMiddleware
from microservice.errors import ServiceError, UpstreamError, error_body
from microservice.health import CachedHealth
from microservice.limits import RequestLimits, read_body
from microservice.metrics import RequestMetricsMiddleware, ServiceMetrics
from microservice.protocol import ChatRequest, GenerationRequest, generated_doc, parse_chat_request
from microservice.request_id import RequestIdMiddleware, current_request_id
from microservice.settings import MicroserviceSettings
from microservice.sse import DONE, error_event, thinking_text
from microservice.upstream import Piece, default_limit, is_model_not_found

logger = logging.getLogger("microservice")


CHAT_PATH = "/v1/chat/completions"
SERVICE_TITLE = "opea_service@llm_vllm"
SERVICE_DESCRIPTION = "Wick LLM microservice: OPEA-compatible chat over the Wick model server"
# Open without the service's API key: probes and scrapers carry none.
OPEN_PATHS = frozenset({"/v1/health_check", "/metrics"})
# Status answered when the client left before the answer (nginx's "client closed request").


# The body is parsed by hand (for clear 400/422 messages), so /docs gets its example here.
_CHAT_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"type": "object"},
                "example": {
                    "messages": {"system": "You are a helpful assistant.", "user": "Hi!"},
                    "max_new_tokens": 32,
                    "top_k": 10,
                    "top_p": 0.95,
                    "typical_p": 0.95,
                    "temperature": 0.01,
                    "repetition_penalty": 1.03,
                    "streaming": False,
                },
            }
        },
    }
}


def build_app(
    settings: MicroserviceSettings,
    connector: Connector,
    metrics: ServiceMetrics | None = None,
) -> FastAPI:
    """The FastAPI app. It owns `connector` and closes it on shutdown."""
    metrics = metrics or ServiceMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info(
            "LLM microservice (%s connector) -> model server at %s",
            connector.name,
            settings.model_server_endpoint,
        )
        try:
            yield
        finally:
            await connector.aclose()

    app = CORSApp(
        title="Wick LLM microservice",
        version=__version__,
        description="OPEA-compatible chat completions over the Wick model server.",
        lifespan=lifespan,
    )
    app.cors = settings.cors  # around everything, the drain and key checks too: see cors.py
    app.state.settings = settings
    app.state.connector = connector
    app.state.metrics = metrics
    chat = _ChatHandler(settings, connector, metrics)
    health = CachedHealth(connector.model_server.probe, settings.health_cache_seconds)

    @app.post(CHAT_PATH, response_model=None, openapi_extra=_CHAT_OPENAPI)
    async def chat_completions(request: Request) -> Response:
        """OPEA's `{"messages": {"system", "user"}, "max_new_tokens", "top_k", "top_p",
        "typical_p", "temperature", "repetition_penalty", "streaming", ...}` or an OpenAI chat
        request. Streams `text/event-stream` when asked to (and not disabled)."""
        return await chat.handle(request)

    @app.get("/v1/health_check", response_model=None)
    async def health_check() -> Response:
        """200 when the model server is ready, 503 when it is not (or unreachable)."""
        state = await health.get()
        body = {
            "Service Title": SERVICE_TITLE,
            "Service Description": SERVICE_DESCRIPTION,
            "version": __version__,
            "connector": connector.name,
            "model_server": state,
        }
        return JSONResponse(body, status_code=200 if state["ready"] else 503)

    @app.get("/metrics", response_model=None)
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.exposition()
        return Response(content, headers={"Content-Type": content_type})

    _add_error_handlers(app, metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, paths=frozenset({CHAT_PATH}))
    if settings.usvc_api_key_value:
        app.add_middleware(APIKeyMiddleware, api_key=settings.usvc_api_key_value)
    app.add_middleware(RequestIdMiddleware, paths=frozenset({CHAT_PATH}))
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)  # outermost: see __main__
    return app


class _ChatHandler:
    def __init__(
        self, settings: MicroserviceSettings, connector: Connector, metrics: ServiceMetrics
    ) -> None:
        self.settings = settings
        self.connector = connector
        self.metrics = metrics
        self.limits = RequestLimits.from_settings(settings)
        self._warned: set[str] = set()

    def _warn_unsupported(self, chat: ChatRequest) -> None:
        # Once per field name and process: a default (OPEA's typical_p) would flood the log.
        for name in chat.ignored_fields():
            if name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "request field %r is not supported by the model server and is ignored "
                    "(this warning is logged once)",
                    name,
                )

    async def handle(self, request: Request) -> Response:
        body = await read_body(request, self.limits.body_size)
        chat = parse_chat_request(body, self.limits)
        self._warn_unsupported(chat)
        stream = chat.wants_stream and not self.settings.disable_streaming
        fmt = formats.choose(self.settings, chat, stream)
        model_server = self.connector.model_server
        try:
            model = await until_disconnected(model_server.resolve_model(chat.model), request)
            try:
                return await self._answer(request, chat, model, stream, fmt)
            except UpstreamError as exc:
                if self.settings.strict_model_name or not is_model_not_found(exc):
                    raise
                # OPEA serves any name with its one model: ask which, once per name.
                substitute = await until_disconnected(model_server.substitute(model), request)
                if substitute is None:
                    raise
                return await self._answer(request, chat, substitute, stream, fmt)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    async def _answer(
        self, request: Request, chat: ChatRequest, model: str, stream: bool, fmt: formats.Format
    ) -> Response:
        generation = await until_disconnected(self._generation(chat, model), request)
        request_id = f"chatcmpl-{current_request_id() or uuid.uuid4().hex}"
        if stream:
            return await self._stream(request, generation, request_id, fmt)
        completion = await until_disconnected(self.connector.answer(generation), request)
        if fmt == "openai":
            return JSONResponse(formats.chat_completion(request_id, model, completion))
        text = thinking_text(completion.text, completion.reasoning, self.settings.include_reasoning)
        return JSONResponse(generated_doc(request_id, text, chat))

    async def _generation(self, chat: ChatRequest, model: str) -> GenerationRequest:
        model_server = self.connector.model_server
        messages = chat.prompt_messages()
        params = chat.sampling_params()
        default = chat.default_max_tokens
        if default is not None:
            # OPEA's default means "at most 1024": sent as is, it would fail every prompt
            # that leaves less than that in the model server's context.
            room = await model_server.completion_room(model, messages, params)
            if (limit := default_limit(default, room)) is not None:
                params["max_tokens"] = limit
        # With documents or a template the messages are no longer OPEA's two parts.
        opea = None if chat.uses_rag else chat.opea_messages
        return GenerationRequest(model=model, messages=messages, params=params, opea=opea)

    async def _stream(
        self,
        request: Request,
        generation: GenerationRequest,
        request_id: str,
        fmt: formats.Format,
    ) -> Response:
        pieces = self.connector.stream(generation)
        # The first piece is awaited before answering, so that failures before any text (model
        # server down, prompt too long, unknown model) get their own status instead of a 200
        # with an error.
        first = await until_disconnected(anext(pieces, None), request)
        started = request.scope.get("state", {}).get("started")
        if first is not None and started is not None:
            self.metrics.ttft.observe(time.monotonic() - started)
        return _ClosingStreamingResponse(
            self._events(
                formats.stream_format(
                    fmt, request_id, generation.model, self.settings.include_reasoning
                ),
                first,
                pieces,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, fmt: formats.StreamFormat, first: Piece | None, pieces: AsyncIterator[Piece]
    ) -> AsyncIterator[str]:
        try:
            for event in fmt.start():
                yield event
            if first is not None:
                for event in fmt.piece(first):
                    yield event
                async for piece in pieces:
                    for event in fmt.piece(piece):
                        yield event
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(kind=exc.kind).inc()
            logger.warning("stream failed: %s", exc.message)
            yield error_event(exc)
        except Exception as exc:  # a bug of ours: still end the stream the way clients expect
            logger.exception("stream failed")
            yield error_event(ServiceError(f"internal error: {type(exc).__name__}: {exc}", 500))
        finally:
            await pieces.aclose()  # type: ignore[attr-defined]
        yield DONE


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however it ends. On a disconnect
    Starlette cancels the task that sends, which may be waiting in `send()` rather than in the
    iterator: the iterator (and the upstream request under it) would then stay open until the
    garbage collector finds it, which for langchain's reference cycles can be never."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _add_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> Response:
        if isinstance(exc, UpstreamError):
            metrics.upstream_errors.labels(kind=exc.kind).inc()
            logger.warning("model server error -> %d: %s", exc.status_code, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, 500), status_code=500)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <LLM_USVC_API_KEY>`, except on OPEN_PATHS (pure ASGI,
    so streaming and disconnect detection are untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "Incorrect or missing API key: send `Authorization: Bearer <key>`."
        response = JSONResponse(
            error_body(message, 401, code="invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)
