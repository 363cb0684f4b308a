"""Offline inference: `LLM(model).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from model_server.config import EngineConfig
from model_server.engine.chat_template import render_chat
from model_server.engine.llm_engine import LLMEngine
from model_server.engine.outputs import RequestOutput
from model_server.lora.request import LoRARequest
from model_server.sampling_params import RequestOutputKind, SamplingParams
from model_server.settings_spec import export_process_settings

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Generate from a list of prompts with continuous batching, like vLLM's offline `LLM`.

    `model=None` loads the embedded SmolLM2; other keyword arguments are EngineConfig fields.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        self._init(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        # cpu_isa, cpu_flags, cache_dir, gguf_weight_cache given here configure the process
        # (its variables), as the command line's flags do: the library loader, the caches and
        # the tensor-parallel workers read them there.
        export_process_settings(config)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (they also stop when this process
        exits). The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.
        `lora_request`: one adapter for every prompt, or one (None: the base model) per prompt
        (needs enable_lora=True)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("need one SamplingParams per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError("need one lora_request per prompt")
        order: dict[str, int] = {}
        for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
            request_id = str(next(self._ids))
            # Only the last output is kept: it holds everything, and no step copies the lists.
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self.engine.add_request(request_id, prompt, params, lora_request=lora)
            order[request_id] = len(order)
        results: list[RequestOutput | None] = [None] * len(order)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[order[out.request_id]] = out
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return render_chat(self.engine.tokenizer, messages)
