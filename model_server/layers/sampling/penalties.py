"""Repetition, presence and frequency penalties, applied sparsely at the seen token ids.

Only the [B, L] seen ids are gathered, transformed and scattered back (as HF does), so the cost
is one copy of the logits plus O(B * L) work, instead of several [B, V] passes (the OPEA
default repetition_penalty=1.03 puts this on the hot path).

Inputs are padded with `vocab_size`. Padding is replaced by a real id of the same row, which
then receives exactly the value its real occurrences write, so duplicate writes in `scatter_`
always agree (deterministic on every device). A row with no ids at all gets a neutral
transform, so rows without penalties keep their logits bit for bit.
"""

from __future__ import annotations

import torch


def _fill_padding(token_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids padded with vocab_size -> (ids with padding replaced by the row's smallest
    real id, or vocab_size - 1 for an empty row; [B] bool: the row has a real id)."""
    if token_ids.shape[1] == 0:
        return token_ids, torch.zeros(token_ids.shape[0], dtype=torch.bool, device=token_ids.device)
    row_min = token_ids.amin(dim=1, keepdim=True)  # [B, 1]; vocab_size when the row is empty
    filled = torch.where(token_ids < vocab_size, token_ids, row_min.clamp(max=vocab_size - 1))
    return filled, row_min.squeeze(1) < vocab_size


def occurrence_counts(token_ids: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[B, L] ids (padding > every real id) and [B, M] real ids -> [B, M] float32 counts of
    each query in its row's ids, by binary search in the sorted row (no [B, V] tensor)."""
    ordered = token_ids.sort(dim=1).values
    hi = torch.searchsorted(ordered, queries, right=True)
    lo = torch.searchsorted(ordered, queries)
    return (hi - lo).to(torch.float32)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
    repetition_token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns penalized logits [B, V] (a new tensor; the input is not modified).

    prompt_token_ids [B, Lp] (needed with a repetition penalty) and output_token_ids [B, Lo]
    are int64 padded with V; penalties are [B] float32 or None.
    - repetition (HF/vLLM): for every token seen in prompt or output, a positive logit is divided
      by the penalty and a negative one multiplied by it.
      `repetition_token_ids` [B, L] (padded with V), when given, are the ids it sees instead of
      prompt + output: candle-vllm's window, the last `repeat_last_n` of them.
    - frequency / presence (OpenAI), then: `logit - frequency * count - presence * (count > 0)`
      over output tokens only.
    """
    vocab_size = logits.shape[-1]
    out = logits.clone()
    if repetition_penalty is not None:
        if repetition_token_ids is None:
            if prompt_token_ids is None:
                raise ValueError("repetition penalty needs the prompt token ids")
            repetition_token_ids = torch.cat([prompt_token_ids, output_token_ids], 1)
        ids, has_ids = _fill_padding(repetition_token_ids, vocab_size)
        factor = torch.where(has_ids, repetition_penalty, 1.0).unsqueeze(1)  # [B, 1]
        seen = out.gather(1, ids)
        out.scatter_(1, ids, torch.where(seen > 0, seen / factor, seen * factor))
    if presence_penalty is not None or frequency_penalty is not None:
        ids, _ = _fill_padding(output_token_ids, vocab_size)
        # An empty row's filler id never occurs in it: count 0, logit unchanged.
        counts = occurrence_counts(output_token_ids, ids)  # [B, Lo]
        seen = out.gather(1, ids)
        if frequency_penalty is not None:
            seen = seen - frequency_penalty.unsqueeze(1) * counts
        if presence_penalty is not None:
            seen = seen - presence_penalty.unsqueeze(1) * (counts > 0).to(torch.float32)
        out.scatter_(1, ids, seen)
    return out
