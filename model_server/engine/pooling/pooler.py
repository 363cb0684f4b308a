"""Pooling: one vector per sequence from the encoder's hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_server.engine.pooling.config import PoolingType


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """`hidden [B, L, H]`, `mask [B, L]` (1 = token; right padding) -> `[B, H]` in float32.

    Mean pooling sums in float32 whatever the model's dtype, so that bf16 rows of long inputs do
    not lose the small tokens' share."""
    if pooling_type is PoolingType.CLS:
        return hidden[:, 0].float()
    if pooling_type is PoolingType.LAST:
        last = mask.sum(dim=1) - 1  # right padding: the last real token's index
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()
    weights = mask.to(torch.float32).unsqueeze(-1)
    summed = (hidden.float() * weights).sum(dim=1)
    return summed / weights.sum(dim=1).clamp(min=1.0)


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation to `dimensions` first, then L2 normalization (the order
    sentence-transformers' `truncate_dim` and vLLM use: a truncated vector is normalized again)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector
