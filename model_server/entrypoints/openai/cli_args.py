"""Flags of `python -m model_server serve` (mirroring `vllm serve`) and how they meet the
environment: a flag given on the command line wins, otherwise the `LLM_*` (or OPEA) variable,
otherwise the default. Imports nothing heavy: `--help` must stay instant."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from model_server.entrypoints.engine_args import add_engine_args
from model_server.settings import DEFAULT_MODEL_NAME, ServerSettings, env_names

SERVE_EPILOG = """\
Every flag can also be set through the environment (the variable names are listed with each
flag; OPEA's LLM_VLLM_MODEL_NAME, LLM_VLLM_PORT, VLLM_DTYPE, VLLM_MAX_NUM_SEQS, VLLM_TP_SIZE,
VLLM_SKIP_WARMUP and VLLM_CPU_KVCACHE_SPACE are accepted too). Flags win over the environment.

Endpoints: GET /health /v1/models /version /metrics, POST /v1/completions /v1/chat/completions
/tokenize /detokenize.
"""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", help="Address to listen on. Default: 0.0.0.0.")
    g.add_argument("--port", type=int, help="Port to listen on. Default: 8008.")
    g.add_argument(
        "--served-model-name",
        help="The model name clients send in requests and see in /v1/models. Default: --model, "
        f"or {DEFAULT_MODEL_NAME} for the embedded model.",
    )
    g.add_argument(
        "--api-key",
        help="Require `Authorization: Bearer <key>` on every endpoint except /health, /metrics "
        "and /version. Default: no key.",
    )
    g.add_argument(
        "--skip-warmup",
        action=argparse.BooleanOptionalAction,
        help="Report ready right after loading, without the warmup requests. Default: warm up.",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        help="Seconds in-flight requests get to finish after SIGTERM/SIGINT; the rest are "
        "aborted. Default: 30.",
    )
    g.add_argument(
        "--kv-cache-dtype", help="KV cache data type. Only auto (the model dtype) for now."
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        help="Log one line per HTTP request. Default: on.",
    )
    g.add_argument(
        "--log-level",
        help="Logging level (to stderr): debug, info, warning, error. Default: info.",
    )
    # Only flags given on the command line may override the environment: no argparse defaults.
    # (Not set_defaults(): argparse would copy its SUPPRESS values into the namespace.)
    for action in parser._actions:
        if action.dest not in ServerSettings.model_fields:
            continue
        action.default = argparse.SUPPRESS
        names = env_names(action.dest)
        if names and action.help:
            action.help = f"{action.help} Env: {', '.join(names)}."


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from the environment, overridden by the flags that were given. Raises
    ValueError with one line per bad setting (named as the user wrote it: flag or variable)."""
    fields = ServerSettings.model_fields
    overrides = {k: v for k, v in vars(args).items() if k in fields}
    try:
        return ServerSettings(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            if name in overrides:
                name = "--" + name.replace("_", "-")
            if err["type"] == "value_error":  # our validators name the bad value themselves
                msg = str(err["msg"]).removeprefix("Value error, ")
            else:
                msg = f"{err['msg']} (got {err.get('input')!r})"
            problems.append(f"{name}: {msg}")
        raise ValueError("invalid settings: " + "; ".join(problems)) from None
