"""Engine-side request state. Pure Python: the scheduler and KV cache manager read and write it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from model_server.engine.outputs import TokenLogprobs
from model_server.lora.request import LoRARequest
from model_server.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_REJECTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "error",
}


class GrammarState(Protocol):
    """A request's grammar matcher as the scheduler drives it (structured_output/manager.py).

    It has consumed exactly the request's output tokens so far: the scheduler feeds it each
    sampled token once, and preemption by recompute keeps the output tokens, so the state stays
    valid; the runner rebuilds it if the counts ever differ."""

    def accept_token(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...


@dataclass(slots=True)
class Request:
    """One sequence being generated.

    Invariants:
      - `all_token_ids == prompt_token_ids + output_token_ids`.
      - `num_computed_tokens <= num_tokens`; tokens `[0, num_computed_tokens)` have their K/V in
        the blocks of `block_ids` (the block table), token i in block `block_ids[i // block_size]`.
      - A request is sampled in a step only when that step brings `num_computed_tokens` up to
        `num_tokens` (the last chunk of a prefill, or a decode).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # For n > 1: the sibling whose prompt blocks this request may share (see KVCacheManager.fork).
    parent: Request | None = None
    # Index of this sample among its siblings (0 for n == 1); added to the seed.
    sample_index: int = 0
    # The LoRA adapter it runs with (None: the base model); keys its prefix-cache blocks.
    lora_request: LoRARequest | None = None

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens of the prompt found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # The sliding-window KV cache group's block table (models with one; see KVCacheManager):
    # entry i covers the tokens of block_ids[i], NULL_BLOCK (0) once out of the window.
    sliding_block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this request's full blocks, in order (filled lazily by the KV manager).
    block_hashes: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Why it stopped: the stop token id or stop string, if any.
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Time the first output token was produced (monotonic), for TTFT metrics.
    first_token_time: float | None = None
    # Structured outputs: the grammar the sampler's bitmask comes from (None: unconstrained).
    grammar: GrammarState | None = None
    # prompt_logprobs: entry j is prompt token j + 1's, gathered chunk by chunk (see
    # `computes_prompt_logprobs`); handed out with the first output.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Whether this request's prefill computes prompt logprobs: it asked for them, it is the
        first sample (siblings share its prompt) and has no output yet (they are handed out with
        the first one; a prefill again after preemption recomputes them from scratch). Such a
        request takes no prefix-cache hit: every prompt position needs its logits."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.parent is None
            and not self.output_token_ids
        )

    @property
    def prefix_cache_key(self) -> tuple[str, int] | None:
        """What its prefix-cache entries are keyed by besides their tokens: the adapter's
        (name, id), so that two adapters (or an adapter and the base model) never share KV
        blocks; None for the base model."""
        return None if self.lora_request is None else self.lora_request.prefix_cache_key

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
