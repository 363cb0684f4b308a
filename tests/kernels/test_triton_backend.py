"""TritonAttentionBackend vs TorchAttentionBackend (the engine's reference) on real metadata."""

from __future__ import annotations

import pytest
import torch

from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.layers.attention import get_attention_backend
from model_server.layers.attention.torch_backend import TorchAttentionBackend
from model_server.layers.attention.triton_backend import TritonAttentionBackend
from tests.kernels.helpers import make_batch, tolerance

pytestmark = pytest.mark.kernels

# Decodes (one crossing a block edge, one long enough for split-K with tile 64, a 1-token prompt)
# mixed with a whole prompt, a chunk after a cached prefix and a prefix-cache-hit tail; the
# caller's order interleaves them so build_model_inputs has to move decodes first.
MIXED = [(0, 13), (16, 1), (9, 30), (130, 1), (0, 1), (16, 5)]


def _backends(num_heads, num_kv_heads, head_dim, split):
    scale = head_dim**-0.5
    kwargs = {"decode_min_split_tokens": 16, "max_decode_splits": 4} if split else {}
    return (
        TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, **kwargs),
        TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale),
    )


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("split", [False, True])
def test_mixed_batch_matches_torch(head_dim, num_heads, num_kv_heads, block_size, split, device):
    b = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        device=device,
    )
    triton_be, torch_be = _backends(num_heads, num_kv_heads, head_dim, split)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = triton_be.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.metadata)
    ref = torch_be.forward(b.q, b.k, b.v, kc, vc, b.metadata)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    torch.testing.assert_close(b.k_cache, kc, atol=0, rtol=0)
    torch.testing.assert_close(b.v_cache, vc, atol=0, rtol=0)


def test_strided_qkv_views(device):
    # q, k, v as views of one fused projection output, as the model layers produce them.
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    b = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        device=device,
    )
    qkv = torch.cat([b.q.flatten(1), b.k.flatten(1), b.v.flatten(1)], dim=1)
    q = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    k, v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    triton_be, torch_be = _backends(num_heads, num_kv_heads, head_dim, split=True)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    out = triton_be.forward(q, k, v, b.k_cache, b.v_cache, b.metadata)
    ref = torch_be.forward(b.q, b.k, b.v, kc, vc, b.metadata)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))


def test_chunked_prefill_then_decode_steps(device):
    """An engine-like run: two prompts prefilled in chunks next to decodes, then decode steps.

    Each backend keeps its own cache across steps, so any store or read error compounds.
    """
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 8
    gen = torch.Generator().manual_seed(3)
    shape = (12, block_size, num_kv_heads, head_dim)
    caches = {
        name: (torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        for name in ("triton", "torch")
    }
    triton_be, torch_be = _backends(num_heads, num_kv_heads, head_dim, split=True)
    tables = {"a": [3, 7, 1, 9, 0], "b": [5, 2, 11, 4]}
    done = {"a": 0, "b": 0}
    # Per step: tokens each sequence runs (a: 37-token prompt in chunks of 16; b: 20-token prompt).
    steps = [{"a": 16, "b": 20}, {"a": 16, "b": 1}, {"a": 5, "b": 1}, {"a": 1, "b": 1}]
    steps += [{"a": 1, "b": 1}] * 2
    for step in steps:
        chunks = [SeqChunk([0] * n, done[name], tables[name]) for name, n in step.items()]
        md = build_model_inputs(chunks, block_size, device).attn_metadata
        num_tokens = sum(step.values())
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
        out = triton_be.forward(q, k, v, *caches["triton"], md)
        ref = torch_be.forward(q, k, v, *caches["torch"], md)
        torch.testing.assert_close(out, ref, **tolerance(torch.float32))
        for name, n in step.items():
            done[name] += n
    torch.testing.assert_close(caches["triton"][0], caches["torch"][0], atol=0, rtol=0)


def test_registered_by_name():
    assert get_attention_backend("triton") is TritonAttentionBackend
    assert TritonAttentionBackend.name == "triton"


@pytest.mark.parametrize(("window", "soft_cap"), [(24, None), (None, 0.8), (13, 1.5)])
@pytest.mark.parametrize("split", [False, True])
def test_sliding_window_and_soft_cap_match_torch(window, soft_cap, split, device):
    """Gemma 2/3 layers: the window and the soft cap, in decodes (split-K included) and in
    prefill chunks after a cached prefix, equal the portable backend's. Blocks wholly before a
    request's window are then swapped for a NaN-filled block (what the KV manager's null block
    may hold): the Triton kernels never read them."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 8
    b = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        device=device,
    )
    extra = {"sliding_window": window, "logits_soft_cap": soft_cap}
    extra = {k: v for k, v in extra.items() if v is not None}
    scale = head_dim**-0.5
    kwargs = {"decode_min_split_tokens": 16, "max_decode_splits": 4} if split else {}
    triton_be = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, **kwargs, **extra)
    torch_be = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, **extra)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ref = torch_be.forward(b.q, b.k, b.v, kc, vc, b.metadata)
    # The capped / windowed result really differs from plain attention.
    plain = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    base = plain.forward(b.q, b.k, b.v, kc.clone(), vc.clone(), b.metadata)
    assert not torch.allclose(base, ref, atol=1e-3)
    if window is not None:
        # One spare block full of NaN stands in for every block behind each request's window.
        used = {block for table in b.block_tables for block in table}
        nan_block = next(i for i in range(b.k_cache.shape[0]) if i not in used)
        b.k_cache[nan_block] = float("nan")
        b.v_cache[nan_block] = float("nan")
        tables = b.metadata.block_tables.clone()
        first_q = [
            s - (b.metadata.query_start_loc_cpu[i + 1] - b.metadata.query_start_loc_cpu[i])
            for i, s in enumerate(b.metadata.seq_lens_cpu)
        ]
        for row, q0 in enumerate(first_q):
            dead = max(0, q0 - window + 1) // block_size
            tables[row, :dead] = nan_block
        b.metadata.block_tables = tables
    out = triton_be.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.metadata)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
