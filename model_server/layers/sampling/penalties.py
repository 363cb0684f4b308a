"""Repetition, presence and frequency penalties over padded token-id tensors.

Padding id is `vocab_size`: it is counted in an extra column that is dropped, so padded rows
(and rows with neutral penalty values) leave their logits bit-for-bit unchanged.
"""

from __future__ import annotations

import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] int64 ids padded with `vocab_size` -> [B, vocab_size] float32 occurrence counts."""
    num_rows = token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor | None,
    presence_penalty: torch.Tensor | None,
    frequency_penalty: torch.Tensor | None,
) -> torch.Tensor:
    """Returns penalized logits [B, V] (a new tensor; the input is not modified).

    - repetition (HF/vLLM): for every token seen in prompt or output, a positive logit is divided
      by the penalty and a negative one multiplied by it. `prompt_token_ids` must be given with it.
    - frequency / presence (OpenAI): `logit -= frequency * count + presence * (count > 0)` over
      output tokens only.
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size)
    if repetition_penalty is not None:
        if prompt_token_ids is None:
            raise ValueError("repetition penalty needs the prompt token ids")
        seen = (token_counts(prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
        penalty = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if frequency_penalty is not None:
        logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    if presence_penalty is not None:
        logits = logits - presence_penalty.unsqueeze(1) * (output_counts > 0).float()
    return logits
