"""Pooling: one vector per sequence from the encoder's hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_server.engine.pooling.config import PoolingType
from model_server.models.pooling_batch import PackedBatch


def pool(hidden: torch.Tensor, batch: PackedBatch, pooling_type: PoolingType) -> torch.Tensor:
    """`hidden [T, H]`, the packed batch's rows -> `[B, H]` in float32, one row per sequence.

    Mean pooling sums in float32 whatever the model's dtype, so that bf16 rows of long inputs do
    not lose the small tokens' share."""
    if pooling_type is PoolingType.CLS:
        return hidden[batch.first_rows()].float()
    if pooling_type is PoolingType.LAST:
        return hidden[batch.last_rows()].float()
    lengths = batch.lengths
    seq_of_row = torch.repeat_interleave(
        torch.arange(batch.num_seqs, device=hidden.device), lengths, output_size=hidden.shape[0]
    )
    summed = hidden.new_zeros((batch.num_seqs, hidden.shape[1]), dtype=torch.float32)
    summed.index_add_(0, seq_of_row, hidden.float())
    return summed / lengths.unsqueeze(1).clamp(min=1).to(torch.float32)


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation to `dimensions` first, then L2 normalization (the order
    sentence-transformers' `truncate_dim` and vLLM use: a truncated vector is normalized again)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector
