"""Builders for paged-attention test batches: random block tables, caches and real metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_server.engine.input_batch import SeqChunk, build_model_inputs
from model_server.layers.attention.backend import AttentionMetadata


@dataclass
class PagedBatch:
    metadata: AttentionMetadata
    block_tables: list[list[int]]  # per request (batch order), host copy
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] this step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], cached prefixes filled in
    v_cache: torch.Tensor


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    fill: float | None = None,
    seed: int = 0,
) -> PagedBatch:
    """`requests`: (num_cached, num_new) per request, in the caller's order.

    Blocks are drawn at random from a pool with spare blocks, so tables are non-contiguous.
    Cached positions get random K/V; every other cache entry is `fill` (NaN catches reads of
    masked slots) or random when `fill` is None. New tokens' K/V are NOT stored.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, tables = [], []
    for (cached, new), nb in zip(requests, needed, strict=True):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        chunks.append(SeqChunk(token_ids=[0] * new, num_computed_tokens=cached, block_ids=table))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fill is None:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    else:
        k_cache = torch.full(shape, fill, dtype=dtype)
        v_cache = torch.full(shape, fill, dtype=dtype)
    cached_slots = [
        table[p // block_size] * block_size + p % block_size
        for (cached, _), table in zip(requests, tables, strict=True)
        for p in range(cached)
    ]
    if cached_slots:
        idx = torch.tensor(cached_slots)
        kv_shape = (len(cached_slots), num_kv_heads, head_dim)
        k_cache.view(-1, num_kv_heads, head_dim)[idx] = torch.randn(kv_shape, generator=gen).to(
            dtype
        )
        v_cache.view(-1, num_kv_heads, head_dim)[idx] = torch.randn(kv_shape, generator=gen).to(
            dtype
        )
    inputs = build_model_inputs(chunks, block_size, device)
    num_tokens = sum(n for _, n in requests)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        metadata=inputs.attn_metadata,
        block_tables=[tables[i] for i in inputs.order],
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 2e-2, "rtol": 2e-2}
