"""Pure-PyTorch references for the Triton kernels: per-token and per-request loops, no tricks.

They are slow on purpose and meant for tests only. Layouts follow
`model_server.layers.attention.backend`.
"""

from __future__ import annotations

import torch


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D]; slot < 0 is skipped."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, offset] = key[t].to(key_cache.dtype)
        value_cache[block, offset] = value[t].to(value_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: list[int], seq_len: int) -> torch.Tensor:
    """One request's first `seq_len` positions from a paged cache: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    rows = [cache[block_table[p // block_size], p % block_size] for p in range(seq_len)]
    return torch.stack(rows)


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    scale: float,
    requests: range | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention, one request and one head at a time, in fp32.

    query: [T, H, D]; request i's queries are rows `[query_start_loc[i], query_start_loc[i+1])`
    at positions ending at `seq_lens[i] - 1`, and see every earlier position of its context
    (all read from the cache). Returns fp32 [T, H, D]; rows of requests outside `requests` are 0.
    With `sliding_window` W a query at position p sees positions (p - W, p] only (blocks before
    that are never read); with `logits_soft_cap` c the scaled scores s become c * tanh(s / c).
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    if requests is None:
        requests = range(len(seq_lens))
    for i in requests:
        start, end = query_start_loc[i], query_start_loc[i + 1]
        query_len, seq_len = end - start, seq_lens[i]
        first = 0  # the first position any query of the request sees
        if sliding_window is not None:
            first = max(0, seq_len - query_len - sliding_window + 1)
        table = block_tables[i]
        # [L, Hkv, D] in fp32 on the query's device, 0 before `first`
        keys = torch.zeros((seq_len, *key_cache.shape[2:]), device=query.device)
        values = torch.zeros((seq_len, *value_cache.shape[2:]), device=query.device)
        keys[first:] = gather_context(key_cache, table, seq_len)[first:].float()
        values[first:] = gather_context(value_cache, table, seq_len)[first:].float()
        for j in range(query_len):
            visible = seq_len - query_len + j + 1  # positions [lo, visible)
            lo = 0 if sliding_window is None else max(0, visible - sliding_window)
            for h in range(num_heads):
                kv = h // group
                scores = keys[lo:visible, kv] @ query[start + j, h].float() * scale
                if logits_soft_cap is not None:
                    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
                out[start + j, h] = torch.softmax(scores, dim=0) @ values[lo:visible, kv]
    return out
