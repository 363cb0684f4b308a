"""Continuous-batching scheduler, vLLM v1 style: one token budget per step, no prefill/decode phase.

Pure policy over `Request` state and the `KVCacheManager`; never touches tensors. Each step
`schedule()` hands every chosen request a number of tokens to compute: 1 for a decode (1 + its
drafts with speculative decoding), a chunk for a (chunked) prefill, drawn from the same
`max_num_batched_tokens` budget. The engine runs the model on exactly those tokens and reports
back through `update_from_output()`, which advances `num_computed_tokens`, appends sampled
tokens, finishes requests and emits the step's `EngineCoreOutput`s. Calls must alternate:
schedule, update, schedule, ... (a request's state only moves in `update_from_output`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from model_server.config import SpeculativeConfig
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.request import Request, RequestStatus
from model_server.engine.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from model_server.engine.spec_decode.metrics import SpecDecodingStats
from model_server.engine.spec_decode.ngram_proposer import NgramProposer
from model_server.engine.spec_decode.policy import (
    AcceptanceFeedback,
    batch_speculates,
    request_speculates,
)

if TYPE_CHECKING:
    from model_server.config import EngineConfig

logger = logging.getLogger(__name__)


# A draft the model runner's draft model fills in (vLLM's placeholder id): never a token.
DRAFT_PLACEHOLDER = -1


@dataclass(slots=True, frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling limits (defaults: EngineConfig's). `max_num_seqs` bounds the running requests,
    `max_num_batched_tokens` the tokens computed per step. Without chunked prefill a prefill is
    scheduled whole or not at all, so the budget must hold the longest possible sequence
    (`max_model_len`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    block_size: int
    # Speculative decoding (n-gram prompt lookup or a draft model); None: off.
    speculative: SpeculativeConfig | None
    # --max-loras with --enable-lora: distinct adapters among the running requests (None: no
    # LoRA, no limit). The model runner has that many device slots.
    max_loras: int | None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}): without chunked prefill a long prompt "
                "could never be scheduled. Raise max_num_batched_tokens or enable chunked prefill."
            )

    @classmethod
    def from_engine_config(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """Build from an `EngineConfig` once the model's context length is known. Without chunked
        prefill the budget is raised to `max_model_len`, as vLLM does. The config's budget must
        be resolved (EngineCore puts the platform's default in place of None)."""
        max_num_batched_tokens = config.max_num_batched_tokens
        if max_num_batched_tokens is None:
            raise ValueError(
                "max_num_batched_tokens is unresolved: the platform's default goes first"
            )
        if not config.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            block_size=config.block_size,
            speculative=SpeculativeConfig.parse(config.speculative_config),
            max_loras=config.max_loras if config.enable_lora else None,
        )


@dataclass(slots=True)
class SchedulerOutput:
    """What to compute this step.

    `scheduled_requests[i]` computes `num_scheduled_tokens[i]` tokens: positions
    `[req.num_computed_tokens, req.num_computed_tokens + n)` of `req.all_token_ids`
    (`num_computed_tokens` is advanced only by `update_from_output`). A request samples a token
    this step iff `req.num_computed_tokens + n == req.num_tokens`. Its block table already covers
    all those positions. `preempted_requests` lost their blocks this step; `finished_request_ids`
    finished since the previous schedule (the runner drops their per-request state).

    Speculative decoding: a decoding request with drafts `d = scheduled_spec_decode_tokens[id]`
    computes `n = 1 + len(d)` positions, its last token then the drafts (not in
    `all_token_ids`), and samples at each of them: the target's token after every prefix
    (`req.num_computed_tokens + n - len(d) == req.num_tokens`).

    With a draft model the scheduler only reserves the positions: `d` holds
    `DRAFT_PLACEHOLDER`s, which the model runner's draft model overwrites in place with its
    drafts before the target's forward (engine/execution/draft_model.py), so
    `update_from_output` counts and verifies the drafts that were run.
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    preempted_requests: list[Request] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, drafts: list[int] | None = None) -> None:
        self.scheduled_requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        self.total_num_scheduled_tokens += num_tokens
        if drafts:
            self.scheduled_spec_decode_tokens[request.request_id] = drafts


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Invariants:
      - `running` is ordered by arrival, so the last one is the most recently arrived; it is the
        one preempted when blocks run out. Preempted requests go to the front of `waiting`.
      - Every request in `running` or `waiting` is in `requests`; finished ones are in neither and
        hold no blocks.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        if kv_cache_manager.block_size != config.block_size:
            raise ValueError(
                f"block_size mismatch: scheduler {config.block_size}, "
                f"KV cache manager {kv_cache_manager.block_size}"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._finished_since_schedule: list[str] = []
        spec = config.speculative
        # None with a draft model: the runner's draft model proposes (DRAFT_PLACEHOLDER).
        self.proposer = (
            None
            if spec is None or spec.uses_draft_model
            else NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        )
        self.spec_decoding_stats = (
            None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        )
        # Per request: fewer drafts, or none for a while, after drafts that did not land.
        self.acceptance = None if spec is None else AcceptanceFeedback(spec.num_speculative_tokens)

    # ----------------------------------------------------------------------------- queries

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    # ------------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS), or raise ValueError if it could never complete."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is not a new request")
        self._check_fits(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        max_len = self.config.max_model_len
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("The prompt is empty: at least one prompt token is required.")
        max_tokens = request.max_tokens
        if max_tokens is None:
            if num_prompt >= max_len:
                raise ValueError(
                    f"This model's maximum context length is {max_len} tokens. However, your "
                    f"prompt has {num_prompt} tokens, which leaves no room for the completion. "
                    "Please reduce the length of the messages."
                )
            total = max_len
        else:
            total = num_prompt + max_tokens
            if total > max_len:
                raise ValueError(
                    f"This model's maximum context length is {max_len} tokens. However, you "
                    f"requested {total} tokens ({num_prompt} in the messages, {max_tokens} in "
                    "the completion). Please reduce the length of the messages or completion."
                )
        # The last sampled token is never computed, so the K/V of `total - 1` tokens is needed.
        kv = self.kv_cache_manager
        if not kv.can_fit(total - 1):
            raise ValueError(
                f"This request needs {kv.num_blocks_for(total - 1)} KV cache blocks "
                f"({total} tokens: {num_prompt} in the messages, {total - num_prompt} in the "
                f"completion) but the cache has only {kv.num_blocks} blocks of {kv.block_size} "
                f"tokens ({kv.num_blocks * kv.block_size} tokens). Please reduce the length of "
                "the messages or completion, or give the KV cache more memory."
            )

    # -------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their blocks.

        Running requests first, in arrival order: each gets min(remaining tokens, budget). When
        blocks run out, the most recently arrived running request is preempted (possibly the one
        being scheduled) and the allocation retried. Then, if nothing was preempted, waiting
        requests in FCFS order while budget and `max_num_seqs` allow; the first one that cannot
        get its blocks (or, without chunked prefill, its whole prefill) stops admission, so later
        requests never overtake it. Sibling samples whose parent has not finished its prompt wait
        without blocking the queue.
        """
        out = SchedulerOutput(finished_request_ids=self._finished_since_schedule)
        self._finished_since_schedule = []
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager

        spec = self.config.speculative
        speculating = spec is not None and batch_speculates(
            len(self.running), spec.disable_by_batch_size
        )
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._propose(request, budget) if speculating and num_new == 1 else []
            num_new += len(drafts)
            while not kv.allocate_slots(request, num_new):
                if drafts:
                    # Blocks for the drafts are not worth a preemption: decode plainly.
                    num_new -= len(drafts)
                    drafts = []
                    continue
                # `running` is in arrival order and only [0, i) got tokens this step, so the last
                # one is the most recently arrived and has nothing scheduled to take back.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_requests.append(victim)
                if victim is request:
                    break
            else:
                out.add(request, num_new, drafts)
                budget -= num_new
                i += 1

        if out.preempted_requests:
            # Blocks are scarce: admitting new work now would only cause more preemption.
            return out

        skipped: list[Request] = []
        loras = self._running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            lora = request.lora_request
            if (
                lora is not None
                and loras is not None
                and lora.lora_int_id not in loras
                and len(loras) >= (self.config.max_loras or 0)
            ):
                # Its adapter has no slot while the running ones hold them all: it waits
                # without blocking requests for the running adapters or the base model.
                self.waiting.popleft()
                skipped.append(request)
                continue
            num_new = self._admit(request, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            if num_new == 0:
                skipped.append(request)
                continue
            out.add(request, num_new)
            budget -= num_new
            if lora is not None and loras is not None:
                loras.add(lora.lora_int_id)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_time)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Drafts for a request with one token left to compute: none unless it is decoding (a
        prompt's last token samples its first output the plain way, with its prompt logprobs)
        and may speculate. Bounded so that the step's positions fit the budget and every token
        it could emit (the drafts and one more) stays within max_tokens and max_model_len, and
        by what its recent drafts' acceptance earns (AcceptanceFeedback). A draft model always
        drafts that many: placeholders here, its tokens filled in by the runner."""
        assert self.acceptance is not None
        if not request.output_token_ids or not request_speculates(
            request.sampling_params, request.num_output_tokens, request.grammar is not None
        ):
            return []
        earned = self.acceptance.max_drafts(request.request_id, request.num_output_tokens)
        limit = min(budget - 1, self.config.max_model_len - request.num_tokens - 1, earned)
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
        if limit <= 0:
            return []
        if self.proposer is None:
            assert self.config.speculative is not None
            return [DRAFT_PLACEHOLDER] * min(limit, self.config.speculative.num_speculative_tokens)
        return self.proposer.propose(request.all_token_ids, limit)

    def lora_adapter_names(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The adapters' names of the running and of the waiting requests (each once, in queue
        order); None without --enable-lora."""
        if self.config.max_loras is None:
            return None

        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            found = (r.lora_request.lora_name for r in requests if r.lora_request is not None)
            return tuple(dict.fromkeys(found))

        return names(self.running), names(self.waiting)

    def _running_loras(self) -> set[int] | None:
        """The adapter ids of the running requests (None without --enable-lora)."""
        if self.config.max_loras is None:
            return None
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _admit(self, request: Request, budget: int) -> int | None:
        """Try to give a waiting request its first tokens and blocks.

        Returns the tokens scheduled (the request's `num_computed_tokens` and block table are set),
        0 for a sibling that must wait for its parent's prompt (nothing changed), or None when it
        does not fit this step (nothing changed; admission stops).
        """
        kv = self.kv_cache_manager
        parent = request.parent
        if parent is not None and not parent.is_finished:
            if (
                parent.status != RequestStatus.RUNNING
                or parent.num_computed_tokens < parent.num_prompt_tokens
            ):
                return 0
            num_computed = kv.fork(parent, request)
            num_new = self._chunk(request.num_tokens - num_computed, budget)
            if num_new is None or not kv.allocate_slots(request, num_new):
                kv.free(request)
                request.num_computed_tokens = 0
                return None
        else:
            # Prompt logprobs need every prompt position's logits: no prefix-cache hit then.
            computed_ids, num_computed = (
                ([], 0) if request.computes_prompt_logprobs else kv.get_computed_blocks(request)
            )
            num_new = self._chunk(request.num_tokens - num_computed, budget)
            if num_new is None or not kv.allocate_slots(
                request, num_new, computed_ids, num_computed
            ):
                return None
            request.num_computed_tokens = num_computed
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed
        return num_new

    def _chunk(self, num_remaining: int, budget: int) -> int | None:
        """Tokens of a prefill to schedule now; None when it must wait (no chunking, too long)."""
        if num_remaining <= budget:
            return num_remaining
        return budget if self.config.enable_chunked_prefill else None

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the blocks, start over from the front of waiting."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---------------------------------------------------------------------------- update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a step's results: advance `num_computed_tokens`, cache newly full blocks, append
        the sampled tokens, check stop conditions and free finished requests. Returns an output
        for each request that got a new token (finished or not), in scheduling order; requests
        finished meanwhile (aborted) are skipped. `runner_output`'s lists are parallel to
        `scheduled_requests` (None where a request did not sample: see SchedulerOutput).
        """
        scheduled = scheduler_output.scheduled_requests
        sampled_token_ids = runner_output.sampled_token_ids
        if len(sampled_token_ids) != len(scheduled):
            raise ValueError(
                f"got {len(sampled_token_ids)} sampled tokens for {len(scheduled)} scheduled "
                "requests"
            )
        kv = self.kv_cache_manager
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        prompt_logprobs = runner_output.prompt_logprobs or [None] * len(scheduled)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for i, (request, num_new, token_id, logprobs, chunk_prompt_logprobs) in enumerate(
            zip(
                scheduled,
                scheduler_output.num_scheduled_tokens,
                sampled_token_ids,
                runner_output.logprobs,
                prompt_logprobs,
                strict=True,
            )
        ):
            if request.is_finished:
                continue
            drafts = spec_tokens.get(request.request_id)
            if drafts:
                if token_id is None or runner_output.spec_token_ids is None:
                    raise ValueError(f"request {request.request_id} verified no drafts")
                spec_logprobs = runner_output.spec_logprobs
                output = self._update_speculative(
                    request,
                    len(drafts),
                    [token_id, *runner_output.spec_token_ids[i]],
                    [logprobs, *spec_logprobs[i]] if spec_logprobs else [],
                )
                any_finished |= request.is_finished
                outputs.append(output)
                continue
            if chunk_prompt_logprobs is not None:
                # Entry j is token j + 1's: this chunk's start onwards (a prefill again after
                # preemption overwrites what the first one gathered).
                del request.prompt_logprobs[request.num_computed_tokens :]
                request.prompt_logprobs.extend(chunk_prompt_logprobs)
            request.num_computed_tokens += num_new
            kv.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that was not the last
            if token_id is None:
                raise ValueError(f"request {request.request_id} was due to sample but got None")
            first_prompt_logprobs = (
                request.prompt_logprobs if request.computes_prompt_logprobs else None
            )
            if request.max_tokens == 0:
                # Prompt logprobs only (echo with max_tokens 0): done after the prefill, the
                # sampled token dropped.
                request.status = RequestStatus.FINISHED_LENGTH
                self._release(request)
                any_finished = True
                outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        new_logprobs=None,
                        finish_reason=RequestStatus.finish_reason(request.status),
                        stop_reason=None,
                        num_cached_tokens=request.num_cached_tokens,
                        prompt_logprobs=first_prompt_logprobs,
                    )
                )
                continue
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status = None
            if request.grammar is not None and not request.grammar.accept_token(token_id):
                # The bitmask allowed only tokens the grammar accepts: a bug, not the input's
                # fault. The matcher cannot go on, so neither can the request.
                logger.error(
                    "request %s: grammar rejected sampled token %d", request.request_id, token_id
                )
                status = RequestStatus.FINISHED_ABORTED
            status = status or self._check_stop(request, token_id)
            if status is not None:
                request.status = status
                self._release(request)
                any_finished = True
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=RequestStatus.finish_reason(request.status),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=first_prompt_logprobs,
                )
            )
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _update_speculative(
        self,
        request: Request,
        num_drafts: int,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
    ) -> EngineCoreOutput:
        """A decoding request that verified `num_drafts` drafts and emits `token_ids` (t_0..t_a,
        the first a drafts accepted; see ModelRunnerOutput). The K/V of its last token and of
        the accepted drafts is kept, the rejected drafts' blocks are released; tokens are
        appended one by one, and a stop condition on one drops those after it."""
        num_accepted = len(token_ids) - 1
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(
                f"request {request.request_id}: {len(token_ids)} tokens for {num_drafts} drafts"
            )
        assert self.spec_decoding_stats is not None
        self.spec_decoding_stats.observe(num_drafts, num_accepted)
        kv = self.kv_cache_manager
        num_computed = request.num_computed_tokens + 1 + num_accepted
        kv.trim(request, num_computed)
        status = None
        new_token_ids: list[int] = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                break
        # The K/V kept: the last token's and the accepted drafts', i.e. every appended token's
        # but the last (computed next step), or all of them when a stop cut the drafts short.
        request.num_computed_tokens = min(num_computed, request.num_tokens)
        kv.cache_blocks(request, request.num_computed_tokens)
        assert self.acceptance is not None
        self.acceptance.observe(
            request.request_id, num_drafts, num_accepted, request.num_output_tokens
        )
        if status is not None:
            request.status = status
            self._release(request)
        new_logprobs = logprobs[: len(new_token_ids)]
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs if any(lp is not None for lp in new_logprobs) else None,
            finish_reason=RequestStatus.finish_reason(request.status),
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status after appending `token_id`, or None to go on.

        EOS and stop token ids count only once `min_tokens` are out, and win over the length
        limits when both apply to the same token (the model did stop there).
        """
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete (ignore_eos too)
        max_tokens = request.max_tokens
        if max_tokens is not None and request.num_output_tokens >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finish waiting or running requests from outside (abort, stop string) and free their
        blocks. Returns the requests finished by this call; unknown or already finished ids are
        ignored, so it is idempotent."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.status = status
            self._release(request)
            finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return finished

    def _release(self, request: Request) -> None:
        if self.acceptance is not None:
            self.acceptance.forget(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_since_schedule.append(request.request_id)
