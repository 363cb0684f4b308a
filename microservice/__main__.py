"""`python -m microservice`: the LLM microservice's command line (flags override the env)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

# Flag -> (settings field, environment variable, help). Keys are not flags on purpose: command
# lines are visible to every user of the machine (ps), the environment is not.
FLAGS: dict[str, tuple[str, str, str]] = {
    "--host": ("host", "LLM_USVC_HOST", "address to listen on (default 0.0.0.0)"),
    "--port": ("port", "LLM_USVC_PORT", "port to listen on (default 9000)"),
    "--model-server-endpoint": (
        "model_server_endpoint",
        "LLM_MODEL_SERVER_ENDPOINT",
        "the model server's base URL (default http://localhost:8008)",
    ),
    "--connector": ("connector", "LLM_CONNECTOR", "generic (default) or langchain"),
    "--model-name": (
        "model_name",
        "LLM_MODEL_NAME",
        "model name sent upstream (default: the request's, else the model server's first)",
    ),
    "--connect-timeout": (
        "connect_timeout",
        "LLM_MODEL_SERVER_CONNECT_TIMEOUT",
        "seconds to connect to the model server before answering 503 (default 1.5)",
    ),
    "--read-timeout": (
        "read_timeout",
        "LLM_MODEL_SERVER_READ_TIMEOUT",
        "longest silence from the model server before answering 504 (default 300)",
    ),
    "--health-cache-seconds": (
        "health_cache_seconds",
        "LLM_HEALTH_CHECK_CACHE_SECONDS",
        "how long a health_check result is reused (default 3)",
    ),
    "--response-format": (
        "response_format",
        "LLM_RESPONSE_FORMAT",
        "auto (default: by what the request sent), enterprise_rag (GeneratedDoc and "
        "data: '<repr>' lines), openai (chat.completion JSON and chunks) or downstream "
        "(GeneratedDoc and data: b'<text>' lines, for a GenAIComps node after this one)",
    ),
    "--log-level": ("log_level", "LLM_USVC_LOG_LEVEL", "debug, info (default), warning, error"),
    "--max-request-body-size": (
        "max_request_body_size",
        "LLM_USVC_MAX_REQUEST_BODY_SIZE",
        "largest request body, e.g. 16MiB (default; a bare number is bytes; 0: no limit): "
        "larger gets 413 before the rest is read",
    ),
    "--max-documents": (
        "max_documents",
        "LLM_USVC_MAX_DOCUMENTS",
        "most RAG documents in one request (default 1000; 0: no limit)",
    ),
    "--max-documents-size": (
        "max_documents_size",
        "LLM_USVC_MAX_DOCUMENTS_SIZE",
        "most text (UTF-8 bytes) in one request's RAG documents, e.g. 8MiB (default; 0: no limit)",
    ),
    "--max-messages": (
        "max_messages",
        "LLM_USVC_MAX_MESSAGES",
        "most chat messages in one request (default 1000; 0: no limit)",
    ),
    "--allowed-origins": (
        "allowed_origins",
        "LLM_USVC_ALLOWED_ORIGINS",
        "origins whose browser pages may call this service (CORS), comma-separated or a JSON "
        "list, * for any (default: none, no CORS headers); preflights need no API key",
    ),
    "--allowed-methods": (
        "allowed_methods",
        "LLM_USVC_ALLOWED_METHODS",
        "HTTP methods cross-origin pages may use (default *)",
    ),
    "--allowed-headers": (
        "allowed_headers",
        "LLM_USVC_ALLOWED_HEADERS",
        "request headers cross-origin pages may send (default *)",
    ),
}
SWITCHES: dict[str, tuple[str, str, str]] = {
    "--disable-streaming": (
        "disable_streaming",
        "LLM_DISABLE_STREAMING",
        "always answer with one JSON body, even when streaming is asked for",
    ),
    "--openai-format-streaming": (
        "openai_format_streaming",
        "LLM_OPENAI_FORMAT_STREAMING",
        "stream OpenAI chat.completion.chunk events instead of OPEA's repr lines",
    ),
    "--include-reasoning": (
        "include_reasoning",
        "LLM_USVC_INCLUDE_REASONING",
        "put a reasoning model's thinking into OPEA's text answers, between <think> and "
        "</think> before the answer (OpenAI's format always carries it, in reasoning_content)",
    ),
    "--strict-model-name": (
        "strict_model_name",
        "LLM_STRICT_MODEL_NAME",
        "answer the model server's 404 to a request naming a model it does not serve, instead "
        "of serving it with the one model there (OPEA's behaviour, the default)",
    ),
    "--allow-credentials": (
        "allow_credentials",
        "LLM_USVC_ALLOW_CREDENTIALS",
        "let cross-origin pages send cookies and HTTP authentication (with --allowed-origins)",
    ),
}

EPILOG = """\
API keys come from the environment only: LLM_API_KEY is sent to the model server as a Bearer
token; LLM_USVC_API_KEY, when set, is required from clients (Authorization: Bearer <key>) on
everything but /v1/health_check and /metrics. Empty variables count as unset.
"""


# Seconds in-flight requests get to finish after SIGTERM/SIGINT.
DRAIN_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes: on SIGTERM/SIGINT the port stays open while in-flight
    requests finish (new ones get 503 with Retry-After, see drain.py), and after the graceful
    shutdown the signal is not re-raised (uvicorn does, so the process would die of it instead
    of exiting 0, which supervisors and `docker stop` read as a crash)."""

    def __init__(self, config: uvicorn.Config, drain: Any = None) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain is not None:
            self.drain.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (
            self.drain is not None
            and self.drain.in_flight
            and time.monotonic() < deadline
            and not self.force_exit
        ):
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(1.0, deadline - time.monotonic())
        await super().shutdown(sockets)

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m microservice",
        description="Wick's LLM microservice: OPEA-compatible chat completions on top of the "
        "Wick model server. Every flag overrides its environment variable.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, (field, env, text) in FLAGS.items():
        parser.add_argument(flag, dest=field, default=None, help=f"{text} [env {env}]")
    for flag, (field, env, text) in SWITCHES.items():
        parser.add_argument(
            flag,
            dest=field,
            default=None,
            action=argparse.BooleanOptionalAction,
            help=f"{text} [env {env}]",
        )
    return parser


def load_settings(argv: Sequence[str] | None = None) -> Any:
    """Settings from the environment, overridden by the flags in `argv`. Bad values exit 2
    with one message per setting."""
    from pydantic import ValidationError

    from microservice.settings import MicroserviceSettings

    parser = build_parser()
    args = parser.parse_args(argv)
    # Passed under their environment names: older pydantic-settings (2.10) let the
    # environment win over an init value given under the field's own name.
    env_names = {field: env for field, env, _ in (*FLAGS.values(), *SWITCHES.values())}
    overrides = {env_names[k]: v for k, v in vars(args).items() if v is not None}
    try:
        return MicroserviceSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        parser.error(f"bad settings: {problems}")


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)

    from microservice.app import build_app
    from microservice.connectors import make_connector

    level = settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every upstream request at INFO: the access log already shows each request.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    app = build_app(settings, make_connector(settings))
    server = _Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,  # our logging setup (stderr), not uvicorn's
            log_level=settings.log_level.lower(),
            timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
        ),
        drain=app.state.drain,
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
