"""The sampler: logits [B, V] of the step's sampled requests -> one token id per request.

Order of operations (as in vLLM v1):
  1. raw logprobs = log_softmax(logits), only when some row asked for logprobs
  2. min_tokens: stop tokens -> -inf for rows below their min_tokens; logit_bias: each row's
     biases added to its logits (so +100 forces a token, -100 bans it, before anything else
     rescales the logits: OpenAI's and vLLM's order)
  3. penalties: repetition (prompt + output), frequency and presence (output)
  4. grammar bitmask: tokens a row's grammar forbids -> -inf, on the constrained rows only
  5. greedy rows: argmax (ties -> lowest id)
  6. random rows: temperature -> min_p -> top_k -> top_p -> exponential race (see
     sampling/ops.py for how top-k/top-p avoid sorting the vocabulary)
Every step is a batched tensor op: no per-request loop except one noise draw per seeded row
(from its own generator), and no device->host read except one per batch when top-p is used
by a batch in which some row has no top-k (the nucleus size check in sampling/ops.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_server.kernels.portable import argmax_torch
from model_server.kernels.table import ArgmaxFn
from model_server.layers.sampling.grammar_mask import apply_grammar_bitmask
from model_server.layers.sampling.metadata import (
    SamplingMetadata,
    SamplingRequest,
    build_sampling_metadata,
)
from model_server.layers.sampling.ops import advance_seeded_row, random_sample, select_candidates
from model_server.layers.sampling.penalties import apply_penalties

__all__ = [
    "PromptLogprobsOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
]

_MASK_64 = (1 << 64) - 1
_MASK_32 = (1 << 32) - 1


def generator_seed(seed: int) -> int:
    """The value a request's `seed` (any 64-bit signed integer) seeds its generator with.

    torch's CPU generator (mt19937) keeps only a seed's low 32 bits, so seeds that differ above
    bit 31 (-1 and 2**32 - 1, say) would sample alike. Seeds below 2**32 are used as they are;
    larger ones (negatives taken modulo 2**64) are hashed (splitmix64's finalizer) into 32 bits.
    The same rule holds on every device (CUDA's generator would keep 64 bits), so that which seeds
    collide does not depend on the device; the random streams themselves still differ by device."""
    x = seed & _MASK_64
    if x <= _MASK_32:
        return x
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    x ^= x >> 31
    return (x ^ (x >> 32)) & _MASK_32


@dataclass(slots=True)
class SamplerOutput:
    # [B] int64: the sampled token of each row.
    sampled_token_ids: torch.Tensor
    # [B] float32: logprob of the sampled token under the raw model distribution (log_softmax of
    # the logits before min_tokens, penalties and temperature); None when no row asked.
    logprobs: torch.Tensor | None = None
    # [B, max_num_logprobs] int64 / float32: the most likely tokens of the raw distribution and
    # their logprobs, sorted descending. Rows that asked for fewer read only their first k.
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


class Sampler:
    """Batched sampler that owns the per-request generators of seeded requests.

    A seeded request's generator is created on its first random sample from
    `seed + sample_index` and advances only with that request's own draws, so a seed gives the
    same tokens whatever the batch around it. Call `release(request_id)` when a request finishes.
    """

    def __init__(self, device: torch.device | str, argmax: ArgmaxFn = argmax_torch) -> None:
        self.device = torch.device(device)
        self.argmax = argmax  # the kernel table's greedy argmax
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Drops a finished (or aborted) request's generator; unknown ids are ignored."""
        self._generators.pop(request_id, None)

    def build_metadata(
        self,
        requests: Sequence[SamplingRequest],
        vocab_size: int,
        grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Metadata for sampling one token for each of `requests` (row i = requests[i]);
        `grammar_bitmask`: (rows, bitmask) of the constrained rows, if any."""
        return build_sampling_metadata(
            requests, vocab_size, self.device, self._generator_for, grammar_bitmask
        )

    def generator_state(self, request_id: str) -> torch.Tensor | None:
        """A copy of a seeded request's generator state (None: it has no generator yet)."""
        generator = self._generators.get(request_id)
        return None if generator is None else generator.get_state()

    def rewind(self, request_id: str, state: torch.Tensor, num_rows: int, vocab_size: int) -> None:
        """Put a seeded request's generator back to `state`, then past the draws of `num_rows`
        sampled rows: where sampling only those rows would have left it."""
        generator = self._generators[request_id]
        generator.set_state(state)
        advance_seeded_row(generator, num_rows, vocab_size, self.device)

    def _generator_for(self, request: SamplingRequest) -> torch.Generator:
        generator = self._generators.get(request.request_id)
        if generator is None:
            seed = request.sampling_params.seed
            if seed is None:
                raise ValueError(f"request {request.request_id} has no seed")
            generator = torch.Generator(device=self.device)
            generator.manual_seed(generator_seed(seed + request.sample_index))
            self._generators[request.request_id] = generator
        return generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] (float32; other dtypes are upcast, except in an all-greedy batch with
        no logprobs, penalties, min_tokens or grammar: its argmax is taken as given). The input
        is modified in one way only: on rows with a grammar, the tokens it forbids become -inf
        (in place, see sampling/grammar_mask.py); the raw logprobs are taken before."""
        if logits.shape != (metadata.num_reqs, metadata.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the metadata "
                f"({metadata.num_reqs}, {metadata.vocab_size})"
            )
        if (
            metadata.all_greedy
            and metadata.max_num_logprobs is None
            and metadata.min_tokens_rows is None
            and metadata.logit_bias_rows is None
            and metadata.output_token_ids is None
            and metadata.grammar_rows is None
        ):
            # Nothing changes the logits: their argmax in the model's dtype is the float32
            # copy's (the upcast is exact and keeps the order), without making the copy.
            return SamplerOutput(sampled_token_ids=self.argmax(logits))
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None

        if metadata.min_tokens_rows is not None:
            logits = logits.index_put(
                (metadata.min_tokens_rows, metadata.min_tokens_token_ids),
                logits.new_full((), float("-inf")),  # filled on the device: no copy
            )
        if metadata.logit_bias_rows is not None:
            assert metadata.logit_bias_token_ids is not None
            assert metadata.logit_bias_values is not None
            # Out of place: `logits.float()` is the caller's tensor when it already was float32.
            # (row, token) pairs are distinct (one dict per row), so accumulate adds each once.
            logits = logits.index_put(
                (metadata.logit_bias_rows, metadata.logit_bias_token_ids),
                metadata.logit_bias_values,
                accumulate=True,
            )
        if metadata.output_token_ids is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalty,
                metadata.presence_penalty,
                metadata.frequency_penalty,
                repetition_token_ids=metadata.repetition_token_ids,
            )

        if metadata.grammar_rows is not None:
            assert metadata.grammar_bitmask is not None
            logits = apply_grammar_bitmask(logits, metadata.grammar_rows, metadata.grammar_bitmask)

        sampled = self._sample(logits, metadata)

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        top_logprobs, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs=raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1),
            top_logprob_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Penalized logits [B, V] -> [B] int64 token ids."""
        if md.all_greedy:
            return self.argmax(logits)
        # Taken before temperature and the filters, which would change nothing for these rows.
        greedy = None if md.all_random else self.argmax(logits)

        candidates = select_candidates(
            logits,
            md.temperature,
            md.top_k,
            md.top_p,
            md.min_p,
            md.max_top_k,
            md.all_top_k,
            md.all_truncated,
        )
        sampled = random_sample(candidates, md.generators, md.vocab_size)

        if greedy is not None and md.greedy_mask is not None:
            sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled


@dataclass(slots=True)
class PromptLogprobsOutput:
    """Prompt logprobs of N positions: the prompt token that follows each, under the model."""

    # [N] int64: the prompt token each position predicts.
    target_ids: torch.Tensor
    # [N] float32: log_softmax(logits)[target] (the raw distribution, as for sampled tokens).
    logprobs: torch.Tensor
    # [N] int64: 1 + the number of tokens more likely than the target.
    ranks: torch.Tensor
    # [N, k] int64 / float32: the k most likely tokens and their logprobs, most likely first.
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> PromptLogprobsOutput:
    """logits [N, V] (any float dtype; upcast) of N prompt positions and the token that follows
    each, target_ids [N] -> each target's logprob and rank, and the top `k` (0: none)."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = (logprobs > target).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return PromptLogprobsOutput(target_ids, target.squeeze(1), ranks, top_ids, top_logprobs)
