"""The portable paged-attention backend against dense causal attention over each whole sequence."""

from __future__ import annotations

import pytest
import torch

from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.layers.attention.torch_backend import TorchAttentionBackend


def dense_attention(q, k, v, scale):
    """q: [n, H, D] (last n positions of the sequence), k, v: [L, Hkv, D] whole sequence."""
    n, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - n, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("block_size", [4, 8])
def test_mixed_batch_matches_dense(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    torch.manual_seed(0)
    head_dim, num_blocks = 16, 64
    # (tokens already cached, tokens computed now): decodes, a fresh prefill, a chunk after a hit.
    shapes = [(9, 1), (0, 11), (3, 1), (8, 7), (16, 1)]
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous block ids
    full_k, full_v, chunks = [], [], []
    for cached, new in shapes:
        total = cached + new
        nb = -(-total // block_size)
        bids = [perm.pop() for _ in range(nb)]
        k = torch.randn(total, num_kv_heads, head_dim)
        v = torch.randn(total, num_kv_heads, head_dim)
        for p in range(cached):  # pre-fill the cached part of the context
            k_cache[bids[p // block_size], p % block_size] = k[p]
            v_cache[bids[p // block_size], p % block_size] = v[p]
        full_k.append(k)
        full_v.append(v)
        chunks.append(SeqChunk(token_ids=[0] * new, num_computed_tokens=cached, block_ids=bids))
    inputs = build_model_inputs(chunks, block_size)
    md = inputs.attn_metadata
    assert md.num_decodes == 3
    qs = [torch.randn(new, num_heads, head_dim) for _, new in shapes]
    q = torch.cat([qs[i] for i in inputs.order])
    k_new = torch.cat([full_k[i][shapes[i][0] :] for i in inputs.order])
    v_new = torch.cat([full_v[i][shapes[i][0] :] for i in inputs.order])
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, md)
    for row, i in enumerate(inputs.order):
        start, end = md.query_start_loc_cpu[row], md.query_start_loc_cpu[row + 1]
        expected = dense_attention(qs[i], full_k[i], full_v[i], backend.scale)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)
    # The new tokens' K/V landed in their slots.
    for t, slot in enumerate(md.slot_mapping.tolist()):
        torch.testing.assert_close(k_cache.view(-1, num_kv_heads, head_dim)[slot], k_new[t])
