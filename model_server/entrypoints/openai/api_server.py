"""The OpenAI-compatible HTTP server: `build_app(engine_client, settings)`, `run_server(settings)`.

Lifecycle: the app's lifespan starts the engine in the background, so the port answers at once
(`/health` is 503 with the phase until the model is loaded and warmed up). SIGTERM/SIGINT: the
port stays open while in-flight requests have `drain_timeout` seconds to finish, new requests
get 503 with Retry-After (and `Connection: close`), then uvicorn's graceful shutdown closes the
listener, the rest are aborted, and the process exits 0. An engine crash fails every pending
request, turns `/health` to 503 and stops the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from model_server import __version__
from model_server.engine.async_engine import EngineClient, EnginePhase
from model_server.entrypoints.openai.chat_page import mount_chat_page
from model_server.entrypoints.openai.cors import CORSApp, CORSPolicy
from model_server.entrypoints.openai.protocol import (
    STOP_SHAPES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from model_server.entrypoints.openai.request_id import RequestIdMiddleware
from model_server.entrypoints.openai.request_limits import BodySizeLimitMiddleware, RequestLimits
from model_server.entrypoints.openai.sampling_defaults import (
    SamplingDefaults,
    resolve_sampling_defaults,
    server_flag_defaults,
)
from model_server.entrypoints.openai.serving_chat import OpenAIServingChat
from model_server.entrypoints.openai.serving_completion import OpenAIServingCompletion
from model_server.entrypoints.openai.serving_engine import json_response, to_api_error
from model_server.entrypoints.openai.serving_models import OpenAIServingModels
from model_server.entrypoints.openai.serving_pooling import POOLING_PATHS
from model_server.entrypoints.openai.serving_responses import OpenAIServingResponses
from model_server.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from model_server.entrypoints.utils import ClientDisconnected, cancel_on_disconnect
from model_server.loader.embedded import embedded_model_path
from model_server.loader.source import ModelLoadError
from model_server.lora.config import LoRAConfig
from model_server.settings import DEFAULT_MODEL_NAME, ServerSettings
from model_server.settings_spec import resolve_max_waiting_requests

logger = logging.getLogger(__name__)

# Paths that stay open with --api-key: probes and scrapers carry no key; the chat page is a
# static file (it asks its user for the key).
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/version"})


def engine_app(engine: Any, settings: ServerSettings, title: str, description: str) -> CORSApp:
    """A FastAPI app whose lifespan starts `engine` (an EngineClient, or the pooling engine:
    anything with start, shutdown and wait_until_failed) and stops it, draining for
    `settings.drain_timeout`; a failed engine stops the server (`_watch_engine`). Set
    `app.state.on_engine_failed` to a callable(message) to hear about an engine crash. CORS is
    applied around everything the caller adds (see cors.py). Serves /health and /version."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        watchdog = asyncio.ensure_future(_watch_engine(app, engine))
        try:
            yield
        finally:
            watchdog.cancel()
            await engine.shutdown(settings.drain_timeout)

    app = CORSApp(title=title, version=__version__, description=description, lifespan=lifespan)
    app.state.engine_client = engine
    app.state.settings = settings
    app.state.on_engine_failed = None
    app.cors = CORSPolicy.from_settings(settings)

    @app.get("/health", response_model=None)
    async def health() -> Response:
        """200 once the model is loaded and warmed up; 503 with the phase before (and when
        draining or failed)."""
        phase = engine.phase
        if phase is EnginePhase.READY:
            return json_response({"status": "ok", "phase": phase.value})
        body: dict[str, Any] = {"status": "unavailable", "phase": phase.value}
        if engine.error_message:
            body["message"] = engine.error_message
        return json_response(body, 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


def build_app(
    engine_client: EngineClient,
    settings: ServerSettings,
    sampling_defaults: SamplingDefaults | None = None,
) -> FastAPI:
    """The FastAPI app over `engine_client`. Its lifespan starts and stops the engine; set
    `app.state.on_engine_failed` to a callable(message) to hear about an engine crash.
    `sampling_defaults`: what requests' unset sampling fields take; None: the server's flags
    only (run_server resolves the generation config too)."""

    app = engine_app(
        engine_client, settings, "Wick model server", "OpenAI-compatible API over the Wick engine."
    )
    engine_client.max_waiting_requests = resolve_max_waiting_requests(
        settings.max_waiting_requests, settings.max_num_seqs
    )
    logger.info(
        "backpressure: %s engine requests may wait (--max-waiting-requests %s)",
        engine_client.max_waiting_requests or "any number of",
        "auto" if settings.max_waiting_requests is None else settings.max_waiting_requests,
    )
    if sampling_defaults is None:
        sampling_defaults = SamplingDefaults(**server_flag_defaults(settings))
    _add_routes(app, engine_client, settings, sampling_defaults)
    mount_chat_page(app)
    _add_error_handlers(app)
    _mount_metrics(app, engine_client, settings)
    if settings.max_request_body_size:
        # Inside the key check: a client without the key gets 401 before its body is read.
        app.add_middleware(BodySizeLimitMiddleware, max_size=settings.max_request_body_size)
    if settings.api_key_value:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key_value)
    # Outermost: even a 401 carries (and logs, and counts) the request id.
    app.add_middleware(
        RequestIdMiddleware,
        log=settings.access_log,
        on_response=lambda path, method, status: _count_http(app, path, method, status),
    )
    return app


# Routes counted under their own path; anything else is "other" (bounded label values).
_COUNTED_ROUTES = frozenset(
    {"/", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize",
     "/detokenize", "/health", "/version", "/metrics"}
)  # fmt: skip


def _count_http(app: FastAPI, path: str, method: str, status: int) -> None:
    metrics = getattr(app.state, "metrics", None)
    if metrics is not None:
        metrics.count_http(path if path in _COUNTED_ROUTES else "other", method, status)


async def _watch_engine(app: FastAPI, engine_client: EngineClient) -> None:
    message = await engine_client.wait_until_failed()
    # Whoever saw the failure logged it once (the engine thread: one line for a model that
    # cannot load, a traceback for a crash; the executor: a dead worker), so a misconfigured
    # start ends with one error line.
    logger.info("stopping the server: the engine failed (%s)", message)
    callback = app.state.on_engine_failed
    if callback is not None:
        callback(message)


def _add_routes(
    app: FastAPI,
    engine_client: EngineClient,
    settings: ServerSettings,
    sampling_defaults: SamplingDefaults,
) -> None:
    lora_config = LoRAConfig.from_engine_config(settings.engine_config())
    if settings.allow_runtime_lora_updating and lora_config is None:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    served = OpenAIServingModels(
        settings.model_names,
        settings.accept_any_model_name,
        lora_config.static_requests() if lora_config is not None else (),
    )
    root = model_root(settings)
    limits = RequestLimits.from_settings(settings)
    completion = OpenAIServingCompletion(engine_client, served, limits)
    chat = OpenAIServingChat(
        engine_client, served, settings.tool_call_parser, limits, settings.reasoning_parser
    )
    tokenization = OpenAIServingTokenization(engine_client, served, limits)
    responses = OpenAIServingResponses(chat)
    completion.sampling_defaults = chat.sampling_defaults = sampling_defaults

    @app.get("/v1/models")
    async def models() -> ModelList:
        # One card per served name, the reported one first (vLLM lists every name the same
        # way): clients that take data[0] get the name responses report.
        cards = [
            ModelCard(
                id=name,
                root=root,
                max_model_len=engine_client.max_model_len,
                quantization=engine_client.quantization,
                kv_cache_dtype=engine_client.kv_cache_dtype,
                capabilities=["generate"],
            )
            for name in served.served_model_names
        ]
        # vLLM's adapter cards: root is the adapter's folder, parent the base model's name.
        cards += [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or served.model_name,
                max_model_len=engine_client.max_model_len,
                capabilities=["generate"],
            )
            for lora in served.lora_requests.values()
        ]
        return ModelList(data=cards)

    if settings.allow_runtime_lora_updating:
        _add_lora_routes(app, engine_client, served)

    @app.post("/v1/completions", response_model=None)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await cancel_on_disconnect(
            completion.create_completion(request, raw_request), raw_request
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await cancel_on_disconnect(
            chat.create_chat_completion(request, raw_request), raw_request
        )

    @app.post("/v1/responses", response_model=None)
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI's Responses API, stateless (served as a chat completion)."""
        return await cancel_on_disconnect(
            responses.create_response(request, raw_request), raw_request
        )

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: TokenizeRequest) -> Response:
        return json_response(tokenization.tokenize(request).model_dump())

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return json_response(tokenization.detokenize(request).model_dump())

    async def refuse_pooling(request: Request) -> Response:
        raise APIError(
            f"{request.url.path}: {served.model_name} is a generative model; embeddings, "
            "reranking and scores need a pooling model (an embedding model or a cross-encoder "
            "served by its own model server)",
            400,
            param="model",
            code="wrong_model_task",
        )

    for path in POOLING_PATHS:
        app.add_api_route(path, refuse_pooling, methods=["POST"], response_model=None)


def _add_lora_routes(
    app: FastAPI, engine_client: EngineClient, served: OpenAIServingModels
) -> None:
    """vLLM's runtime adapter loading (--allow-runtime-lora-updating): 200 with a line of text,
    400 for a bad adapter (the engine's reason) or a name in use, 404 to unload an unknown
    name."""

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        lora = served.new_lora_request(request.lora_name, request.lora_path)
        try:
            await engine_client.add_lora(lora)
        except ValueError as exc:
            raise APIError(str(exc), 400, param="lora_path") from None
        except RuntimeError as exc:  # not ready, draining, dead
            raise to_api_error(exc) from None
        served.add_lora_request(lora)
        logger.info("loaded LoRA adapter %s from %s", lora.lora_name, lora.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        lora = served.remove_lora_request(request.lora_name)
        try:
            await engine_client.remove_lora(lora.lora_int_id)
        except RuntimeError as exc:
            raise to_api_error(exc) from None
        logger.info("unloaded LoRA adapter %s", lora.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")


def chat_page_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the chat page."""
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/"


def model_root(settings: ServerSettings) -> str:
    """What /v1/models reports as `root`: the model as loaded (vLLM: the --model value). With no
    --model that is the embedded GGUF; its hub id stands in when the package is missing (the
    engine then fails to load, but the card must still name something)."""
    given = (settings.model or "").strip()
    if given:
        return given
    try:
        return embedded_model_path()
    except ModelLoadError:
        return DEFAULT_MODEL_NAME


# ------------------------------------------------------------------------------- errors


def _error(status_code: int, message: str, param: str | None = None, **kw: Any) -> Response:
    err = APIError(message, status_code, param=param, **kw)
    return json_response(err.to_response().model_dump(), status_code)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        response = json_response(exc.to_response().model_dump(), exc.status_code)
        response.headers.update(getattr(exc, "headers", {}))  # Retry-After on 503s
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # OpenAI answers malformed requests with 400, not FastAPI's 422.
        message, param = validation_message(exc.errors(), request.headers.get("content-type"))
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        message = body_error_message(exc)
        if message is None:
            message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _error(exc.status_code, message)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        # Nobody reads this; nginx's "client closed request" keeps access logs honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


# FastAPI's detail for a body it could not decode (fastapi/routing.py).
_FASTAPI_BODY_ERROR = "There was an error parsing the body"


def body_error_message(exc: StarletteHTTPException) -> str | None:
    """What was wrong with a body FastAPI could not parse, or None for other HTTP errors.

    FastAPI turns JSON syntax errors into a RequestValidationError, but any other failure of
    `json.loads(body)` (bytes that are not UTF-8, nesting deep enough to hit the recursion
    limit) into a bare 400 "There was an error parsing the body", chaining the real cause."""
    cause = exc.__cause__
    if exc.detail != _FASTAPI_BODY_ERROR or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"the request body is not valid UTF-8 (byte {_utf8_error_at(cause)}): send UTF-8 JSON"
        )
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    return f"the request body could not be read as JSON: {type(cause).__name__}: {cause}"


def _utf8_error_at(exc: UnicodeDecodeError) -> int:
    # json.loads guesses UTF-16/32 from the first bytes (a BOM, NULs): the failed decode may not
    # have been UTF-8's, so its offset would point at the wrong byte.
    try:
        bytes(exc.object).decode("utf-8")
    except UnicodeDecodeError as utf8:
        return utf8.start
    return exc.start


def validation_message(errors: Any, content_type: str | None = None) -> tuple[str, str | None]:
    """A readable one-line message (and the first bad field) from pydantic's errors."""
    parts: list[str] = []
    param = None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "malformed JSON")
            where = f" at position {loc[0]}" if loc else ""
            parts.append(f"the request body is not valid JSON: {detail}{where}")
            continue
        if not loc:
            if kind == "value_error":  # a check across fields (a model validator)
                parts.append(str(err.get("msg", "")).removeprefix("Value error, "))
            elif content_type and "json" not in content_type.lower():
                parts.append(
                    f"the request body must be JSON (Content-Type: application/json), "
                    f"got Content-Type: {content_type}"
                )
            elif kind == "missing":
                parts.append("the request body is missing: send a JSON object")
            else:
                parts.append(f"the request body must be a JSON object: {err.get('msg')}")
            continue
        param = param or loc[0]
        union = _union_field(loc)
        if union is not None:
            path, hint = union
            parts.append(f"{path}: must be {hint}")
            continue
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind not in ("missing", "value_error", "json_invalid") and "input" in err:
            shown = repr(err["input"])
            if len(shown) <= 60:
                msg = f"{msg} (got {shown})"
        parts.append(f"{'.'.join(loc)}: {msg}")
    # Unions report one error per alternative: keep the message short.
    unique = list(dict.fromkeys(parts))
    if len(unique) > 4:
        unique = [*unique[:4], f"... ({len(unique) - 4} more)"]
    return "; ".join(unique) or "invalid request", param


# Fields that accept several shapes: pydantic reports one error per shape, we say what fits.
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...})",
    "stop": STOP_SHAPES,
    "tool_choice": "a string or an object",
}
_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _union_field(loc: list[str]) -> tuple[str, str] | None:
    """(path, hint) when `loc` points into one alternative of a known union field."""
    for j, part in enumerate(loc[:-1]):
        tag = loc[j + 1]
        if part in _UNION_HINTS and (tag in _SCALAR_TAGS or "[" in tag or tag[:1].isupper()):
            return ".".join(loc[: j + 1]), _UNION_HINTS[part]
    return None


# --------------------------------------------------------------------------------- auth


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <api_key>`, except on OPEN_PATHS (pure ASGI, so
    streaming and disconnect detection are untouched)."""

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
        response = _error(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


# ------------------------------------------------------------------------------ metrics


def _mount_metrics(app: FastAPI, engine_client: EngineClient, settings: ServerSettings) -> None:
    """GET /metrics from `model_server.metrics` (Prometheus, vLLM's metric names)."""
    try:
        from model_server.metrics import EngineMetrics, mount_metrics

        metrics = EngineMetrics(settings.model_name, settings.max_model_len or 8192)
    except ImportError as exc:
        logger.warning("/metrics disabled: %s", exc)
        return
    engine_client.stat_loggers.append(metrics)
    app.state.metrics = metrics
    mount_metrics(app)


# ------------------------------------------------------------------------------- server


def run_server(settings: ServerSettings, notes: Sequence[str] = ()) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or an engine failure (exit code 1). `notes`:
    what the command line's aliases said (logged once logging is set up)."""
    from model_server.engine.async_engine import AsyncLLM

    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    for note in notes:
        logger.info("%s", note)
    # Read before the engine loads the model: a missing --generation-config folder fails fast.
    sampling_defaults = resolve_sampling_defaults(settings)
    engine = AsyncLLM(settings.engine_config(), skip_warmup=settings.skip_warmup)
    app = build_app(engine, settings, sampling_defaults)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # our logging setup (stderr), not uvicorn's
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
    logger.info(
        "serving %s on http://%s:%d (drain timeout %.0fs); chat page at %s",
        settings.model_name,
        settings.host,
        settings.port,
        settings.drain_timeout,
        chat_page_url(settings.host, settings.port),
    )
    server.run()
    return server.exit_code


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, with three changes: a signal first tells the engine to refuse new work;
    the listener stays open while in-flight requests drain, so new ones get the engine's 503 with
    Retry-After rather than a refused connection; and after a graceful shutdown the signal is not
    re-raised (uvicorn does, which would make the process die of SIGTERM instead of exiting 0)."""

    def __init__(
        self,
        config: Any,
        on_signal: Callable[[], None],
        busy: Callable[[], bool] = lambda: False,
        drain_timeout: float = 0.0,
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._busy = busy
        self._drain_timeout = drain_timeout
        self.exit_code = 0

    async def shutdown(self, sockets: Any = None) -> None:
        if self.exit_code == 0:  # a signal; an engine failure has nothing left to drain
            deadline = time.monotonic() + self._drain_timeout
            while self._busy() and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            # What is left of the drain timeout goes to uvicorn's wait for the last responses.
            self.config.timeout_graceful_shutdown = max(1.0, deadline - time.monotonic())
        await super().shutdown(sockets)

    def fail(self, message: str) -> None:
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("received %s: draining", signal.Signals(sig).name)
            self._on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
