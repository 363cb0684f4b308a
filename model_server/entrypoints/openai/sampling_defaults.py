"""Server-wide sampling defaults: what a request's unset sampling fields take.

Precedence, per field: the request's own value; else the server's flag (`--temperature`,
`--top-p`, `--top-k`, `--repetition-penalty`/`--penalty`, `--max-tokens`/`--max-gen-tokens`);
else the model's generation_config.json (`--generation-config auto|FOLDER`, as vLLM's, which
reads the same five fields); else OpenAI's default. `--repeat-last-n` (candle-vllm's window of
the repetition penalty) has no request field: it is the server's alone.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Any

from model_server.loader.model_info import model_folder, read_generation_config

logger = logging.getLogger(__name__)

# generation_config.json's names -> ours (vLLM's `ModelConfig.get_diff_sampling_param` reads
# the same fields; max_new_tokens becomes the default max_tokens).
_GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """None: no default (the request's field, or OpenAI's default, decides)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    repeat_last_n: int = 0  # 0: the repetition penalty sees the whole sequence

    def describe(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.repeat_last_n:
            del values["repeat_last_n"]  # 0 is no window: nothing to say
        return ", ".join(f"{k}={v}" for k, v in values.items() if v is not None)


def _from_generation_config(config: dict[str, Any], path: str) -> dict[str, Any]:
    """The sampling fields of a generation_config.json that hold usable values; others are
    dropped with a warning (a bad file must not make every request a 400)."""
    out: dict[str, Any] = {}
    for key, name in _GENERATION_CONFIG_FIELDS.items():
        value = config.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or not _valid(name, value):
            logger.warning("%s: ignoring %s=%r (out of range)", path, key, value)
            continue
        out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out


def _valid(name: str, value: float) -> bool:
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":
        return value >= -1
    if name == "repetition_penalty":
        return value > 0
    return value >= 1  # max_tokens


def generation_config_defaults(
    generation_config: str, model: str | None, load_format: str = "auto"
) -> tuple[dict[str, Any], str | None]:
    """(sampling fields, the file they came from) of `--generation-config`: auto (the model's
    folder; none for a GGUF file, the embedded model or a dummy preset), none, or a folder.
    ValueError for a FOLDER that does not exist."""
    import os

    choice = generation_config.strip()
    if choice.lower() == "none":
        return {}, None
    if choice.lower() == "auto":
        try:
            folder = model_folder(model, load_format)
        except ValueError:  # ModelLoadError: the engine reports it, in its own words
            return {}, None
        if folder is None:
            return {}, None
    else:
        folder = os.path.expanduser(choice)
        if not os.path.isdir(folder):
            raise ValueError(
                f"--generation-config {choice!r}: not auto, none, or a folder (no such folder)"
            )
    path = os.path.join(folder, "generation_config.json")
    config = read_generation_config(folder)
    return _from_generation_config(config, path), (path if config else None)


def resolve_sampling_defaults(settings: Any) -> SamplingDefaults:
    """The defaults `settings` (ServerSettings) give, generation config included; logs at INFO
    what was applied and from where."""
    found, path = generation_config_defaults(
        settings.generation_config, settings.model, settings.load_format
    )
    flags = server_flag_defaults(settings)
    defaults = SamplingDefaults(**{**found, **flags})
    if path is not None:
        applied = {k: v for k, v in found.items() if k not in flags}
        logger.info(
            "generation config %s: sampling defaults %s (--generation-config %s)",
            path,
            ", ".join(f"{k}={v}" for k, v in applied.items()) or "none applied",
            settings.generation_config,
        )
    if defaults.describe():
        logger.info("sampling defaults for requests that leave them unset: %s", defaults.describe())
    return defaults


def server_flag_defaults(settings: Any) -> dict[str, Any]:
    """The sampling defaults the server's own flags set (no generation config)."""
    names = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "repeat_last_n")
    return {n: getattr(settings, n) for n in names if getattr(settings, n, None) is not None}
