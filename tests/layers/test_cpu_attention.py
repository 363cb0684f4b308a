"""The native CPU decode kernel (kernels/cpu/paged_decode.c) against the portable backend."""

from __future__ import annotations

import logging

import pytest
import torch

from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
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


def _run_both(
    shapes: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One step of `shapes` (cached, new) through the portable and the CPU backends; returns
    (cpu output, portable output, how many times the native kernel ran)."""
    k_cache, v_cache, inputs, gen = _paged_batch(
        shapes, num_kv_heads, head_dim, block_size, num_blocks
    )
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    md = inputs.attn_metadata
    total = md.query_start_loc_cpu[-1]
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache.clone(), v_cache.clone(), md
    )
    calls = []
    kernel = native.paged_decode
    monkeypatch.setattr(native, "paged_decode", lambda *a: calls.append(1) or kernel(*a))
    out = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache, v_cache, md
    )
    monkeypatch.setattr(native, "paged_decode", kernel)
    return out, expected, len(calls)


def test_kernel_builds_here() -> None:
    # CI machines have a C compiler: the fast path must really be taken, not silently skipped.
    assert native.load_library() is not None


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 64), (6, 1, 32)],
)
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_portable_backend(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, monkeypatch
) -> None:
    # Context lengths on both sides of block boundaries, incl. a one-token context.
    shapes = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 2, 1), (70, 1)]
    out, expected, calls = _run_both(
        shapes, num_heads, num_kv_heads, head_dim, block_size, 256, monkeypatch
    )
    assert calls == 1  # all five are decodes, computed by the kernel in one call
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_mixed_batch_prefills_unchanged(monkeypatch) -> None:
    """Decodes go to the kernel, prefills (fresh and after a cache hit) to SDPA, in one step."""
    shapes = [(9, 1), (0, 11), (3, 1), (8, 7), (16, 1)]
    out, expected, calls = _run_both(shapes, 6, 2, 32, 4, 64, monkeypatch)
    assert calls == 1
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_non_fp32_falls_back_to_portable_path(monkeypatch) -> None:
    out, expected, calls = _run_both(
        [(5, 1), (12, 1)], 4, 2, 16, 8, 16, monkeypatch, dtype=torch.bfloat16
    )
    assert calls == 0
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
        out, expected, calls = _run_both([(7, 1)], 4, 2, 16, 4, 8, monkeypatch)
        assert calls == 0
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
    num_threads: int, num_heads: int, num_kv_heads: int, head_dim: int, monkeypatch
) -> None:
    """With >= 4 sequences per thread a work item covers all kv heads of a sequence (the other
    code path of the kernel): same results."""
    shapes = [(n, 1) for n in (0, 5, 7, 8, 9, 15, 16, 17, 30, 41, 63, 64)]
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, expected, calls = _run_both(
            shapes, num_heads, num_kv_heads, head_dim, 8, 128, monkeypatch
        )
    finally:
        torch.set_num_threads(previous)
    assert calls == 1
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
