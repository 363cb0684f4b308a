"""The native CPU decode kernel (kernels/cpu/paged_decode.c) against the portable backend."""

from __future__ import annotations

import logging

import pytest
import torch

from model_server.engine.input_batch import SeqChunk, build_model_inputs
from model_server.kernels.cpu import native
from model_server.layers.attention.cpu_backend import CpuAttentionBackend
from model_server.layers.attention.torch_backend import TorchAttentionBackend


def _paged_batch(shapes, num_kv_heads, head_dim, block_size, num_blocks, seed=0):
    """Random caches holding `cached` tokens per request at scattered blocks; returns the caches,
    the model inputs for computing `new` tokens per request, and k/v/q for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = []
    for cached, new in shapes:
        bids = [perm.pop() for _ in range(-(-(cached + new) // block_size))]
        for p in range(cached):
            k_cache[bids[p // block_size], p % block_size] = torch.randn(
                num_kv_heads, head_dim, generator=gen
            )
            v_cache[bids[p // block_size], p % block_size] = torch.randn(
                num_kv_heads, head_dim, generator=gen
            )
        chunks.append(SeqChunk(token_ids=[0] * new, num_computed_tokens=cached, block_ids=bids))
    return k_cache, v_cache, build_model_inputs(chunks, block_size), gen


def test_kernel_builds_here() -> None:
    # CI machines have a C compiler: the fast path must really be taken, not silently skipped.
    assert native.load_library() is not None


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64), (6, 1, 32)],
)
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_portable_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    # Context lengths on both sides of block boundaries, incl. a one-token context.
    shapes = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 2, 1), (70, 1)]
    k_cache, v_cache, inputs, gen = _paged_batch(
        shapes, num_kv_heads, head_dim, block_size, num_blocks=256
    )
    md = inputs.attn_metadata
    assert md.num_decodes == len(shapes)
    q = torch.randn(len(shapes), num_heads, head_dim, generator=gen)
    k = torch.randn(len(shapes), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(shapes), num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), md
    )
    backend = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale)
    out = backend.forward(q, k, v, k_cache, v_cache, md)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_mixed_batch_prefills_unchanged() -> None:
    """Decodes go to the kernel, prefills (fresh and after a cache hit) to SDPA, in one step."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 4
    shapes = [(9, 1), (0, 11), (3, 1), (8, 7), (16, 1)]
    k_cache, v_cache, inputs, gen = _paged_batch(
        shapes, num_kv_heads, head_dim, block_size, num_blocks=64
    )
    md = inputs.attn_metadata
    total = md.query_start_loc_cpu[-1]
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), md
    )
    out = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache, v_cache, md
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_non_fp32_falls_back_to_portable_path() -> None:
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    k_cache, v_cache, inputs, gen = _paged_batch(
        [(5, 1), (12, 1)], num_kv_heads, head_dim, block_size, num_blocks=16
    )
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    md = inputs.attn_metadata
    q = torch.randn(2, num_heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(2, num_kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(2, num_kv_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), md
    )
    out = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache, v_cache, md
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


def test_build_is_cached_and_keyed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    native.load_library.cache_clear()
    try:
        assert native.load_library() is not None
        built = list((tmp_path / "kernels").glob("paged_decode-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        native.load_library.cache_clear()
        assert native.load_library() is not None
        assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    finally:
        native.load_library.cache_clear()


def test_no_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            backend = CpuAttentionBackend(4, 2, 16, 0.25)
        assert backend.lib is None
        assert "no C compiler" in caplog.text
        k_cache, v_cache, inputs, gen = _paged_batch([(7, 1)], 2, 16, 4, num_blocks=8)
        q = torch.randn(1, 4, 16, generator=gen)
        k = torch.randn(1, 2, 16, generator=gen)
        v = torch.randn(1, 2, 16, generator=gen)
        expected = TorchAttentionBackend(4, 2, 16, 0.25).forward(
            q, k, v, k_cache.clone(), v_cache.clone(), inputs.attn_metadata
        )
        out = backend.forward(q, k, v, k_cache, v_cache, inputs.attn_metadata)
        torch.testing.assert_close(out, expected)
    finally:
        native.load_library.cache_clear()


def test_broken_compiler_falls_back(tmp_path, monkeypatch, caplog) -> None:
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: fatal error: broken' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: str(fake_cc))
    native.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.load_library() is None
        assert "broken" in caplog.text and "falling back to PyTorch" in caplog.text
    finally:
        native.load_library.cache_clear()


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 48)])
def test_large_batches_take_whole_sequence_items(
    num_threads: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """With >= 4 sequences per thread a work item covers all kv heads of a sequence (the other
    code path of the kernel): same results."""
    block_size = 8
    shapes = [(n, 1) for n in (0, 5, 7, 8, 9, 15, 16, 17, 30, 41, 63, 64)]
    k_cache, v_cache, inputs, gen = _paged_batch(
        shapes, num_kv_heads, head_dim, block_size, num_blocks=128
    )
    md = inputs.attn_metadata
    q = torch.randn(len(shapes), num_heads, head_dim, generator=gen)
    k = torch.randn(len(shapes), num_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(shapes), num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), md
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
            q, k, v, k_cache, v_cache, md
        )
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
