"""The synchronous engine: tokenization, the engine core and output processing in one loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from model_server.config import EngineConfig
from model_server.engine.core.request import Request
from model_server.engine.core.scheduler import Scheduler
from model_server.engine.engine_core import EngineCore
from model_server.engine.output_processor import OutputProcessor
from model_server.engine.outputs import RequestOutput
from model_server.engine.stats import CacheConfigInfo
from model_server.lora.request import LoRARequest
from model_server.sampling_params import SamplingParams
from model_server.structured_output.manager import StructuredOutputManager


class LLMEngine:
    """Text in, text out around the `EngineCore`: tokenizes prompts, fans a request out into its
    `n` samples, and turns the core's outputs into `RequestOutput`s (detokenized, stop strings)."""

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        # Grammar compiles for structured outputs; `compile` is safe from any thread (the
        # server compiles off this thread before adding a request: async_engine.py).
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.core.eos_token_id
        )

    @property
    def config(self) -> EngineConfig:
        """The configuration as resolved at startup (see EngineCore)."""
        return self.core.config

    @property
    def max_model_len(self) -> int:
        assert self.core.config.max_model_len is not None  # resolved by the core
        return self.core.config.max_model_len

    @property
    def quantization(self) -> str | None:
        """What the model's linear layers run, e.g. "gptq w4 g128" or "int8"; None: float."""
        return self.core.model_runner.quantization_description

    @property
    def cache_config_info(self) -> CacheConfigInfo:
        return self.core.cache_config_info

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def scheduler(self) -> Scheduler:
        """Read-only for callers: its counters and live requests feed the stats."""
        return self.core.scheduler

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (all `params.n` samples); raises ValueError if it can never run.
        `prompt_token_ids`: the text `prompt` already tokenized (as `tokenize` does);
        `lora_request`: the adapter it runs with (None: the base model)."""
        if lora_request is not None:
            self.core.check_lora(lora_request)
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize(prompt)
        constraint = params.structured_outputs
        if constraint is not None:
            self.structured_output.compile(constraint)  # raises before anything is queued
        text = prompt if isinstance(prompt, str) else None
        child_ids = self.output_processor.add_request(request_id, text, prompt_token_ids, params)
        added: list[str] = []
        try:
            first: Request | None = None
            for index, child_id in enumerate(child_ids):
                request = Request(
                    request_id=child_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=params,
                    eos_token_id=self.core.eos_token_id,
                    parent=first,
                    sample_index=index,
                    lora_request=lora_request,
                    grammar=(
                        self.structured_output.new_grammar(constraint)
                        if constraint is not None
                        else None
                    ),
                )
                self.core.add_request(request)
                added.append(child_id)
                first = first or request
        except ValueError:
            self.core.abort_requests(added)
            self.output_processor.remove_request(request_id)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (ValueError with the reason); it then serves requests."""
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort any number of requests in one scheduler pass: O(ids + live requests), where
        one call per id would rebuild the scheduler's queues once per id (O(n^2) for a flood)."""
        core_ids: list[str] = []
        for request_id in request_ids:
            core_ids.extend(self.output_processor.remove_request(request_id))
        if core_ids:
            self.core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs on another thread if a tensor-parallel worker dies."""
        self.core.add_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        outputs, to_stop = self.output_processor.process_outputs(self.core.step())
        if to_stop:
            self.core.stop_requests(to_stop)
        return outputs
