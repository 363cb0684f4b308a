"""Which model names a request may use (vLLM's `OpenAIServingModels`, for the one served model).

`--served-model-name a b c`: `a` is the name responses, /metrics and the first /v1/models card
report; `b` and `c` are aliases a request may use, listed as cards of their own. With
`--accept-any-model-name` any name is answered by the served model, for clients that hard-code
one (candle-vllm's samples send `llama7b`, `llama`, `mistral7b`); otherwise an unknown name is
vLLM's (and OpenAI's) 404 `model_not_found`.

With --enable-lora, each LoRA adapter is a model name of its own (vLLM's): `--lora-modules`
ones from the start (ids 1, 2, ... as the engine loaded them), and with
--allow-runtime-lora-updating those `/v1/load_lora_adapter` adds (ids after them; a name
unloaded and loaded again gets a new id, so nothing cached for the old one is reused).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from model_server.entrypoints.openai.protocol import APIError
from model_server.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Unknown names logged once each, up to this many: names come from clients, so the set of
# those already logged must stay bounded.
_MAX_LOGGED_NAMES = 64


class OpenAIServingModels:
    def __init__(
        self,
        served_model_names: Sequence[str],
        accept_any_model_name: bool = False,
        lora_requests: Sequence[LoRARequest] = (),
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.served_model_names = tuple(served_model_names)
        self.accept_any_model_name = accept_any_model_name
        self._logged: set[str] = set()
        # Adapter name -> its request, in the order they were added (/v1/models lists them so).
        self.lora_requests: dict[str, LoRARequest] = {}
        for lora in lora_requests:
            self._check_new_name(lora.lora_name)
            self.lora_requests[lora.lora_name] = lora
        self._next_lora_id = 1 + max((r.lora_int_id for r in lora_requests), default=0)

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]

    def is_base_model(self, name: str) -> bool:
        return name in self.served_model_names

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 as `check_model`."""
        if model and model in self.lora_requests:
            return self.lora_requests[model]
        self.check_model(model)
        return None

    def response_name(self, model: str | None) -> str:
        """The name a response reports: an adapter's own, else the first served name."""
        return model if model and model in self.lora_requests else self.model_name

    def check_model(self, model: str | None) -> None:
        """404 for a name this server does not serve, unless any name is accepted. A missing or
        empty name means "the one you serve", which single-model clients rely on."""
        if not model or self.is_base_model(model) or model in self.lora_requests:
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

    # ---- LoRA adapters ------------------------------------------------------------------------

    def _check_new_name(self, name: str) -> None:
        if not name:
            raise APIError("lora_name must not be empty", 400, param="lora_name")
        if name in self.lora_requests:
            raise APIError(
                f"The lora adapter '{name}' has already been loaded.", 400, param="lora_name"
            )
        if self.is_base_model(name):
            raise APIError(
                f"The lora adapter name '{name}' is a name of the base model.",
                400,
                param="lora_name",
            )

    def new_lora_request(self, name: str, path: str) -> LoRARequest:
        """A request for an adapter not loaded yet (400 for a name in use); register it with
        `add_lora_request` once the engine accepted it."""
        self._check_new_name(name)
        if not path:
            raise APIError("lora_path must not be empty", 400, param="lora_path")
        lora = LoRARequest(name, self._next_lora_id, path, self.model_name)
        self._next_lora_id += 1
        return lora

    def add_lora_request(self, lora: LoRARequest) -> None:
        self._check_new_name(lora.lora_name)  # another load of the name may have won meanwhile
        self.lora_requests[lora.lora_name] = lora

    def remove_lora_request(self, name: str) -> LoRARequest:
        """Unregister an adapter (vLLM's 404 for a name not loaded)."""
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise APIError(
                f"The lora adapter '{name}' cannot be found.",
                404,
                param="lora_name",
                code="model_not_found",
            )
        return lora

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
