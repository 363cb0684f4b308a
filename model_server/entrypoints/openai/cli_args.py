"""Flags of `python -m model_server serve` (mirroring `vllm serve`) and how they meet the
environment: a flag given on the command line wins, otherwise the `LLM_*` (or OPEA) variable,
otherwise the default. Imports nothing heavy: `--help` must stay instant."""

from __future__ import annotations

import argparse
import textwrap

from pydantic import ValidationError

from model_server.entrypoints.seed_flags import add_alias_arguments, apply_flag_aliases
from model_server.settings import ServerSettings
from model_server.settings_spec import SETTINGS, add_arguments

_OPEA = [n for s in SETTINGS for n in s.opea]
_ENV_NOTE = (
    "Every flag can also be set through the environment (the variable names are listed with "
    f"each flag; OPEA's {', '.join(_OPEA[:-1])} and {_OPEA[-1]} are accepted too). Flags win "
    "over the environment; see docs/configuration.md."
)
SERVE_EPILOG = f"""{textwrap.fill(_ENV_NOTE, width=95)}

Endpoints: GET /health /v1/models /version /metrics, POST /v1/completions /v1/chat/completions
/tokenize /detokenize.
"""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None, so the namespace tells given flags from the rest (see add_arguments).
    add_arguments(parser, "engine", from_environment=True)
    add_arguments(parser, "server", from_environment=True)
    add_alias_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Settings from the environment, overridden by the flags that were given. Raises
    ValueError with one line per bad setting (named as the user wrote it: flag or variable)."""
    # The seeds' flags (--w, --mem, ...) become the settings they stand for; what they note is
    # logged once logging is set up (run_server).
    args.startup_notes = [*getattr(args, "startup_notes", []), *apply_flag_aliases(args)]
    fields = ServerSettings.model_fields
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    try:
        return ServerSettings(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if err["type"] == "value_error":  # our validators name the bad value themselves
                msg = str(err["msg"]).removeprefix("Value error, ")
            else:
                msg = f"{err['msg']} (got {err.get('input')!r})"
            if not err["loc"]:  # a check across settings: its message names them
                problems.append(msg)
                continue
            name = str(err["loc"][0])
            if name in given:
                name = "--" + name.replace("_", "-")
            # (A WICK_* variable's message starts with its name already.)
            problems.append(msg if msg.startswith(f"{name}=") else f"{name}: {msg}")
        raise ValueError("invalid settings: " + "; ".join(problems)) from None
