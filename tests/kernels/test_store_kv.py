"""store_kv_cache vs the per-token reference: layouts, padding slots, dtype casts, strides."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.reference import store_kv_reference
from model_server.kernels.store_kv import store_kv_cache

pytestmark = pytest.mark.kernels


def _run(num_kv_heads, head_dim, block_size, src_dtype, cache_dtype, device, fused=False):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11, 20]] = -1  # padding tokens
    if fused:
        # k and v as views of one fused [T, (2 * Hkv + 1) * D] projection: strided token rows.
        qkv = torch.randn(num_tokens, (2 * num_kv_heads + 1) * head_dim, generator=gen)
        qkv = qkv.to(src_dtype).to(device)
        k = qkv[:, head_dim : (num_kv_heads + 1) * head_dim].view(-1, num_kv_heads, head_dim)
        v = qkv[:, (num_kv_heads + 1) * head_dim :].view(-1, num_kv_heads, head_dim)
    else:
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
        k, v = k.to(device), v.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=cache_dtype, device=device)
    v_cache = torch.full(shape, -7.0, dtype=cache_dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = slots.to(device)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_reference(k, v, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"),
    [(2, 64, 16), (3, 128, 8), (1, 64, 8), (8, 128, 16), (4, 256, 32)],
)
def test_store_kv_matches_reference(num_kv_heads, head_dim, block_size, device):
    _run(num_kv_heads, head_dim, block_size, torch.float32, torch.float32, device)


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_store_kv_dtypes(src_dtype, cache_dtype, device):
    _run(2, 64, 8, src_dtype, cache_dtype, device)


def test_store_kv_strided_views(device):
    _run(2, 64, 16, torch.float32, torch.float32, device, fused=True)


def test_store_kv_empty_is_noop(device):
    k = torch.empty(0, 2, 64, device=device)
    cache = torch.zeros(2, 8, 2, 64, device=device)
    store_kv_cache(k, k, cache, cache, torch.empty(0, dtype=torch.int64, device=device))
    assert not cache.any()
