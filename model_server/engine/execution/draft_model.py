"""Draft-model speculative decoding (vLLM's `draft_model` method): a smaller model of the
target's tokenizer proposes each speculating request's drafts, greedily, before the target's
forward verifies them.

The draft is a second `ModelRunner` on the same platform, loaded as the target is (same loader,
the target's dtype, its context length), with a KV cache of its own whose blocks mirror the
target's: the same block count and size, read through the target's block tables and slots. So
the scheduler's block pool holds both (a block costs the target's bytes plus the draft's, see
`ModelRunner.bytes_per_block`), and what frees or trims a target block frees the draft's too.

Per step (`DraftModelProposer.propose`, on rank 0 before the target's forward):

1. One forward of the draft over every request that drafts or runs a prefill chunk: its tokens
   from where the draft's K/V stops being valid (`_DraftState`) to the end of the step's own
   tokens. Prefill chunks thus keep the draft in step; a request that decoded plainly for a
   while, was forked or lost drafts catches up here; one that hit the prefix cache catches up
   only from the first cached block whose draft K/V the draft did not write for those tokens
   (`_full_blocks`). The last row of a drafting request gives its first draft (argmax).
2. `n - 1` more one-token forwards, each feeding the previous draft: drafts 1 .. n - 1.

The drafts overwrite the scheduler's placeholders (scheduler.DRAFT_PLACEHOLDER) in place. A
draft is one token (q one-hot), so the target's verification (verify.py) stays exact for greedy
and sampled requests alike.

Invariant: a request's draft K/V at positions `[0, min(state.num_computed,
request.num_computed_tokens))` is the draft's for its real tokens in its current blocks. Every
position the draft wrote holds either a real token or a draft, and a draft below the target's
`num_computed_tokens` was accepted, i.e. is the real token; rejected drafts' positions are past
it and are written again before being read (as the target's are). Blocks change under a request
only by preemption (its `num_preemptions` then differs: the state starts over) or by freeing it.
The draft writes only slots the target writes with the same token, so shared blocks (prefix
cache, forks) stay consistent.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from model_server.config import EngineConfig, SpeculativeConfig
from model_server.engine.core.request import Request
from model_server.engine.core.scheduler import DRAFT_PLACEHOLDER, SchedulerOutput
from model_server.engine.execution.input_batch import SeqChunk
from model_server.engine.execution.model_preparation import PreparedModel, prepare_model
from model_server.loader import load_model_source
from model_server.platforms import Platform

if TYPE_CHECKING:
    from model_server.engine.execution.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prepare_draft_model(
    target: EngineConfig,
    spec: SpeculativeConfig,
    target_hf_config: object,
    target_dtype: torch.dtype,
    platform: Platform,
) -> PreparedModel:
    """The draft of `spec.model`, prepared like the target (`target`: its config with
    max_model_len resolved) in the target's dtype. ValueError for a draft that cannot draft for
    this target: another vocabulary size, a shorter context, sliding-window layers."""
    assert spec.model is not None and target.max_model_len is not None
    source = load_model_source(spec.model, target.load_format)
    draft_vocab = int(source.hf_config.vocab_size)
    target_vocab = int(target_hf_config.vocab_size)  # type: ignore[attr-defined]
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config: the draft model {spec.model} has a vocabulary of {draft_vocab} "
            f"tokens, the target {target_vocab}: a draft must share the target's tokenizer"
        )
    if source.context_length < target.max_model_len:
        raise ValueError(
            f"speculative_config: the draft model {spec.model} has a context of "
            f"{source.context_length} tokens, shorter than the served {target.max_model_len}: "
            "lower --max-model-len"
        )
    config = dataclasses.replace(
        target,
        model=spec.model,
        dtype=str(target_dtype).removeprefix("torch."),
        speculative_config=None,
        quantization_param_path=None,  # the target's per-layer KV scales
        hf_overrides=None,
        enable_lora=False,
        lora_modules=None,
    )
    prepared = prepare_model(config, source, platform)
    if prepared.kv_groups.hybrid:
        raise ValueError(
            f"speculative_config: the draft model {spec.model} has sliding-window layers with "
            "a block pool of their own, which a draft's mirrored cache does not have"
        )
    return prepared


@dataclass(slots=True)
class _DraftState:
    """One request's draft K/V: valid below min(num_computed, the request's own)."""

    num_computed: int = 0
    num_preemptions: int = 0
    num_remembered_blocks: int = 0  # its leading full blocks entered in `_full_blocks`


@dataclass(slots=True)
class DraftModelProposer:
    """Rank 0's draft model and the per-request state of its KV cache (see the module)."""

    runner: ModelRunner
    _states: dict[str, _DraftState] = field(default_factory=dict)
    # Block id -> the prefix-cache hash of the full block whose draft K/V it holds, written by
    # the draft for that block's real tokens. A request finding the block in the prefix cache
    # under that hash (same tokens, same positions: the hash chains the whole prefix) needs no
    # catch-up over it. An entry goes when the draft writes into the block again (a freed and
    # reused block then holds other K/V); a block the target alone rewrote (plain decodes)
    # gets a new hash unless its tokens are the same, and then the draft's K/V still is theirs.
    _full_blocks: dict[int, int] = field(default_factory=dict)

    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's cache: as many blocks as the target's, the same ids."""
        self.runner.allocate_kv_cache(num_blocks)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def _state(self, request: Request) -> _DraftState:
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            # New, or preempted since: its blocks are new, nothing of the draft's is in them.
            state = self._states[request.request_id] = _DraftState(
                num_preemptions=request.num_preemptions
            )
        return state

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> None:
        """Fill the step's placeholder drafts with the draft model's greedy tokens (and keep
        its cache in step over the step's prefill chunks)."""
        spec = out.scheduled_spec_decode_tokens
        chunks: list[SeqChunk] = []
        ends: list[int] = []  # per chunk: the end of the request's own tokens this step
        drafting: list[tuple[int, Request, list[int]]] = []  # (chunk index, request, drafts)
        for request, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True):
            drafts = spec.get(request.request_id)
            if drafts and drafts[0] != DRAFT_PLACEHOLDER:
                continue  # not the draft model's (no other proposer runs beside it)
            start = request.num_computed_tokens
            own = n - len(drafts or ())
            if not drafts and own == 1 and start >= request.num_prompt_tokens:
                continue  # a plain decode: caught up when it next drafts
            state = self._state(request)
            valid = min(state.num_computed, start)
            self._remember_full_blocks(request, state, valid)
            if valid < start:  # new to the draft, or behind: from the cache where it can
                valid = max(valid, self._cached_prefix(request, start))
            end = start + own
            self._forget_blocks(request, valid, end + max(len(drafts or ()) - 1, 0))
            if drafts:
                drafting.append((len(chunks), request, drafts))
            chunks.append(SeqChunk(request.all_token_ids[valid:end], valid, request.block_ids))
            ends.append(end)
            state.num_computed = end
        if not drafting:
            if chunks:
                self.runner.forward_chunks(chunks)
            return
        hidden, last_token_indices, order = self.runner.forward_chunks(chunks)
        # hidden's rows are in batch order; the drafting chunks' last rows give drafts 0.
        batch_row = {idx: row for row, idx in enumerate(order)}
        rows = [batch_row[idx] for idx, _, _ in drafting]
        index = torch.tensor(rows, dtype=torch.int64, device=self.runner.device)
        if last_token_indices is not None:
            index = last_token_indices[index]
        tokens = self._greedy(hidden[index])
        for j in range(max(len(d) for _, _, d in drafting)):
            for (_, _, drafts), token in zip(drafting, tokens, strict=True):
                drafts[j] = token
            drafting = [
                (idx, request, drafts) for idx, request, drafts in drafting if len(drafts) > j + 1
            ]
            if not drafting:
                break
            # Draft j at position end + j: its K/V, and draft j + 1 from its logits.
            step = [
                SeqChunk([drafts[j]], ends[idx] + j, request.block_ids)
                for idx, request, drafts in drafting
            ]
            for idx, request, _ in drafting:
                self._states[request.request_id].num_computed = ends[idx] + j + 1
            hidden, last_token_indices, order = self.runner.forward_chunks(step)
            assert order == list(range(len(step)))  # one token each: no reordering
            tokens = self._greedy(
                hidden if last_token_indices is None else hidden[last_token_indices]
            )

    def _remember_full_blocks(self, request: Request, state: _DraftState, valid: int) -> None:
        """Enter the request's full, hashed blocks below `valid` (its draft K/V for its real
        tokens there) in `_full_blocks`."""
        num = min(valid // self.runner.block_size, len(request.block_hashes))
        for i in range(state.num_remembered_blocks, num):
            self._full_blocks[request.block_ids[i]] = request.block_hashes[i]
        state.num_remembered_blocks = max(state.num_remembered_blocks, num)

    def _cached_prefix(self, request: Request, start: int) -> int:
        """How many of the request's leading positions (at most `start`) lie in blocks whose
        draft K/V `_full_blocks` vouches for under the block's own hash."""
        i = 0
        for block_id, block_hash in zip(request.block_ids, request.block_hashes, strict=False):
            if self._full_blocks.get(block_id) != block_hash:
                break
            i += 1
        return min(i * self.runner.block_size, start)

    def _forget_blocks(self, request: Request, begin: int, end: int) -> None:
        """The draft writes positions [begin, end) of the request: their blocks' entries go."""
        size = self.runner.block_size
        for i in range(begin // size, min(-(-end // size), len(request.block_ids))):
            self._full_blocks.pop(request.block_ids[i], None)

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        """The draft's argmax token for each row of `hidden` [R, hidden_size]."""
        logits = self.runner.model.compute_logits(hidden)
        return torch.argmax(logits, dim=-1).tolist()
