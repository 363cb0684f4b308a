"""Which model names a request may use (vLLM's `OpenAIServingModels`, for the one served model).

`--served-model-name a b c`: `a` is the name responses, /metrics and the first /v1/models card
report; `b` and `c` are aliases a request may use, listed as cards of their own. With
`--accept-any-model-name` any name is answered by the served model, for clients that hard-code
one (candle-vllm's samples send `llama7b`, `llama`, `mistral7b`); otherwise an unknown name is
vLLM's (and OpenAI's) 404 `model_not_found`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from model_server.entrypoints.openai.protocol import APIError

logger = logging.getLogger(__name__)

# Unknown names logged once each, up to this many: names come from clients, so the set of
# those already logged must stay bounded.
_MAX_LOGGED_NAMES = 64


class OpenAIServingModels:
    def __init__(
        self, served_model_names: Sequence[str], accept_any_model_name: bool = False
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.served_model_names = tuple(served_model_names)
        self.accept_any_model_name = accept_any_model_name
        self._logged: set[str] = set()

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def is_base_model(self, name: str) -> bool:
        return name in self.served_model_names

    def check_model(self, model: str | None) -> None:
        """404 for a name this server does not serve, unless any name is accepted. A missing or
        empty name means "the one you serve", which single-model clients rely on."""
        if not model or self.is_base_model(model):
            return
        if self.accept_any_model_name:
            self._log_unknown(model)
            return
        raise APIError(
            f"The model `{model}` does not exist. This server serves {self._names_text()} "
            "(a server started with --accept-any-model-name answers any name).",
            404,
            param="model",
            code="model_not_found",
        )

    def _names_text(self) -> str:
        first, *aliases = self.served_model_names
        text = f"`{first}`"
        if aliases:
            text += " (also named " + ", ".join(f"`{a}`" for a in aliases) + ")"
        return text

    def _log_unknown(self, model: str) -> None:
        if model in self._logged or len(self._logged) >= _MAX_LOGGED_NAMES:
            return
        self._logged.add(model)
        logger.info(
            "model %r is not a served name: answered by %s (--accept-any-model-name)",
            model,
            self.model_name,
        )
