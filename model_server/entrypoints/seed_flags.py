"""The seeds' flags on `serve`'s parser, and how they become Wick's settings: declared in
model_server/settings_aliases.py, applied here before the settings layer reads the namespace.
Imports nothing heavy: `--help` must stay instant."""

from __future__ import annotations

import argparse
import os
from typing import Any

from model_server.settings_aliases import FLAG_ALIASES, MODEL_TYPE_HELP, MODEL_TYPES
from model_server.settings_spec import parse_device_ids, parse_size


def add_alias_arguments(parser: argparse.ArgumentParser) -> None:
    """The seeds' flags and the positional model type, each storing None unless given."""
    g = parser.add_argument_group("candle-vllm and vLLM-GCU flags (aliases of the above)")
    for a in FLAG_ALIASES:
        kwargs: dict[str, Any] = {"dest": a.dest, "default": None, "help": a.help}
        if a.switch:
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        else:
            kwargs["metavar"] = a.metavar
        g.add_argument(*a.flags, **kwargs)
    g.add_argument(
        "model_type",
        nargs="?",
        default=None,
        choices=list(MODEL_TYPES),
        metavar="MODEL_TYPE",
        help=MODEL_TYPE_HELP,
    )


def _given(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, None)


def _set(args: argparse.Namespace, name: str, value: Any, alias: str) -> None:
    """Sets a setting from an alias; the setting's own flag with another value is a conflict."""
    current = getattr(args, name, None)
    if current is not None and current != value:
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{alias} and {flag} disagree ({value!r} vs {current!r}): give one")
    setattr(args, name, value)


def _model(args: argparse.Namespace) -> str | None:
    folder = _given(args, "alias_weight_path")
    hub_id = _given(args, "alias_model_id")
    gguf = _given(args, "alias_f")
    if gguf is not None:
        if hub_id is not None:
            raise ValueError("--f (a local GGUF file) and --model-id name two models: give one")
        if folder is not None and not os.path.isabs(gguf):
            return os.path.join(folder, gguf)
        return str(gguf)
    if folder is not None and hub_id is not None:
        raise ValueError("--weight-path and --model-id name two models: give one")
    return folder if folder is not None else hub_id


def _devices(args: argparse.Namespace, ids: str) -> list[str]:
    parsed = parse_device_ids(str(ids)) or []
    _set(args, "device_ids", str(ids), "--d")
    if len(parsed) > 1 and getattr(args, "tensor_parallel_size", None) is None:
        args.tensor_parallel_size = len(parsed)  # candle-vllm shards over every id
        return [f"--d {ids}: tensor parallel over {len(parsed)} devices (-tp {len(parsed)})"]
    return []


def _port(args: argparse.Namespace, port: str) -> list[str]:
    if not str(port).isdigit():
        raise ValueError(f"--p must be a port number, got {port!r}")
    _set(args, "port", int(port), "--p")
    return []


def _mem(args: argparse.Namespace, mem: str) -> list[str]:
    text = str(mem).strip()
    try:
        float(text)
        text += "MiB"  # a bare number: candle-vllm's unit
    except ValueError:
        pass
    try:
        parse_size(text)
    except ValueError as exc:
        raise ValueError(f"--mem: {exc}") from None
    _set(args, "kv_cache_memory", text, "--mem")
    return []


def _prefill_chunk_size(args: argparse.Namespace, chunk: str) -> list[str]:
    try:
        size = int(chunk)
    except ValueError:
        raise ValueError(f"--prefill-chunk-size must be a token count, got {chunk!r}") from None
    if size < 0:
        raise ValueError(f"--prefill-chunk-size must be non-negative, got {size}")
    _set(args, "enable_chunked_prefill", size > 0, "--prefill-chunk-size")
    if size > 0:
        _set(args, "max_num_batched_tokens", size, "--prefill-chunk-size")
    return []


def _quant(args: argparse.Namespace, quant: str) -> list[str]:
    # candle-vllm's q8_0 quantizes the float weights to 8 bits at load: Wick's int8.
    method = "int8" if str(quant).strip().lower() == "q8_0" else str(quant)
    _set(args, "quantization", method, "--quant")
    return []


def _log(args: argparse.Namespace, _: bool) -> list[str]:
    _set(args, "access_log", True, "--log")
    if getattr(args, "log_level", None) is None:
        args.log_level = "info"
    return []


def _disable_log_requests(args: argparse.Namespace, _: bool) -> list[str]:
    _set(args, "access_log", False, "--disable-log-requests")
    return []


def _trust_remote_code(args: argparse.Namespace, _: bool) -> list[str]:
    return [
        "--trust-remote-code: accepted and ignored; Wick implements every architecture it "
        "loads and never runs a checkpoint's own code"
    ]


# Alias dest -> what applies it (the model's three aliases are read together: `_model`).
_APPLY = {
    "alias_d": _devices,
    "alias_p": _port,
    "alias_mem": _mem,
    "alias_prefill_chunk_size": _prefill_chunk_size,
    "alias_quant": _quant,
    "alias_log": _log,
    "alias_disable_log_requests": _disable_log_requests,
    "alias_trust_remote_code": _trust_remote_code,
}


def _swallowed_model_type(args: argparse.Namespace) -> list[str]:
    """A model type word at the end of --served-model-name's names (nargs="+" took it)."""
    names = getattr(args, "served_model_name", None)
    if getattr(args, "model_type", None) is not None or not isinstance(names, list):
        return []
    if len(names) > 1 and names[-1] in MODEL_TYPES:
        return [
            f"--served-model-name took {names[-1]!r} as a model name; for candle-vllm's model "
            "type put it before --served-model-name or after `--`"
        ]
    return []


def apply_flag_aliases(args: argparse.Namespace) -> list[str]:
    """Writes the given aliases into their settings on `args` (and clears them, so a second
    call is a no-op); returns what to log at startup. ValueError for a conflict or a bad
    value, naming the flag."""
    notes: list[str] = []
    model = _model(args)
    if model is not None:
        _set(args, "model", model, "--weight-path/--model-id/--f")
    for dest, apply in _APPLY.items():
        value = _given(args, dest)
        if value is not None:
            notes += apply(args, value)
    notes += _swallowed_model_type(args)
    for a in FLAG_ALIASES:
        setattr(args, a.dest, None)
    return notes


def check_model_type(model_type: str | None, architectures: list[str] | None) -> None:
    """candle-vllm's positional model type against the model's architectures (config.json's);
    ValueError naming both on a mismatch. None (not given, or unknown before loading) passes."""
    if model_type is None or not architectures:
        return
    accepted = MODEL_TYPES[model_type]
    if not set(accepted) & set(architectures):
        raise ValueError(
            f"model type {model_type!r} does not match the model, which is "
            f"{', '.join(architectures)} ({model_type!r} means {' or '.join(accepted)}); "
            "drop the model type or pass the matching one"
        )
