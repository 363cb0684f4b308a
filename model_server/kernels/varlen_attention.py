"""Attention over a pooling step's packed sequences, without a KV cache: the portable version of
the kernel table's `varlen_attention` slot (the CPU platform's is kernels/cpu/
varlen_attention.c, the CUDA platform's kernels/varlen_attention_triton.py). Each sequence's
tokens attend over its own tokens only, bidirectionally (encoders) or causally (decoder embedding
models); nothing is padded.

Contract of the slot: q [T, heads * D] and k, v [T, kv_heads * D] (row-strided views of a fused
projection are fine), `cu_seqlens` [B + 1] int32 on the CPU (sequence s owns rows
cu[s]:cu[s + 1]), `scale` multiplies q . k, `causal` limits query j to keys 0..j of its
sequence; returns a new [T, heads * D] in q's dtype. Inputs are never written.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA on each sequence's rows (one call per sequence)."""
    d = q.shape[1] // num_heads
    out = q.new_empty((q.shape[0], num_heads * d))
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        if end == start:
            continue
        qs, ks, vs = (
            t[start:end].reshape(end - start, -1, d).transpose(0, 1) for t in (q, k, v)
        )  # [heads, len, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[start:end] = o.transpose(0, 1).reshape(end - start, num_heads * d)
    return out
