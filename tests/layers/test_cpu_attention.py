"""The CPU attention backend (native kernels/cpu/paged_attention.c) against the portable backend,
on each ISA path this machine runs, and its fallbacks (one warning, then the portable path)."""

from __future__ import annotations

import logging

import pytest
import torch

from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.layers.attention import cpu_backend
from model_server.layers.attention.cpu_backend import CpuAttentionBackend
from model_server.layers.attention.torch_backend import TorchAttentionBackend

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
TOL = {torch.float32: {"atol": 3e-5, "rtol": 3e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


@pytest.fixture(params=RUNNABLE[:1] + [i for i in RUNNABLE[1:] if i == "avx2"])
def isa(request, monkeypatch):
    """The best path, and the forced AVX2 one where the CPU has better."""
    monkeypatch.setenv(isa_mod.CPU_ISA_ENV, request.param)
    isa_mod._choose.cache_clear()
    native.clear_cache()
    yield request.param
    isa_mod._choose.cache_clear()
    native.clear_cache()


@pytest.fixture
def fresh_warnings():
    cpu_backend._warn_fallback.cache_clear()
    yield
    cpu_backend._warn_fallback.cache_clear()


def _paged_batch(shapes, num_kv_heads, head_dim, block_size, num_blocks, seed=0):
    """Random caches holding `cached` tokens per request at scattered blocks; returns the caches,
    the model inputs for computing `new` tokens per request, and the generator."""
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
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_ref, v_ref, md
    )
    calls = []
    kernel = native.paged_attention
    monkeypatch.setattr(
        native, "paged_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    out = CpuAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, k_cache, v_cache, md
    )
    monkeypatch.setattr(native, "paged_attention", kernel)
    # The same K/V stored (by the kernel on the native path, before it attends).
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    return out, expected, len(calls)


def test_kernel_builds_here() -> None:
    # CI machines have a C compiler: the fast path must really be taken, not silently skipped.
    assert native.load_kernels() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 80), (6, 1, 72)],
)
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_portable_backend(
    isa, dtype, num_heads, num_kv_heads, head_dim, block_size, monkeypatch
) -> None:
    # Context lengths on both sides of block boundaries, incl. a one-token context.
    shapes = [(0, 1), (block_size - 1, 1), (block_size, 1), (3 * block_size + 2, 1), (70, 1)]
    out, expected, calls = _run_both(
        shapes, num_heads, num_kv_heads, head_dim, block_size, 256, monkeypatch, dtype
    )
    assert calls == 1  # all five are decodes, computed by the kernel in one call
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_batch_in_one_call(isa, dtype, monkeypatch) -> None:
    """Decodes and prefills (fresh, after a cache hit, longer than a query tile) in one call."""
    shapes = [(9, 1), (3, 1), (16, 1), (0, 11), (8, 7), (5, 40), (0, 1)]
    out, expected, calls = _run_both(shapes, 6, 2, 32, 4, 64, monkeypatch, dtype)
    assert calls == 1
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_float16_falls_back_with_one_warning(monkeypatch, fresh_warnings, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two layers / steps: still one warning
            out, expected, calls = _run_both(
                [(5, 1), (12, 3)], 4, 2, 16, 8, 16, monkeypatch, dtype=torch.float16
            )
    assert calls == 0
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected)
    warnings = [r for r in caplog.records if "paged_attention.c" in r.getMessage()]
    assert len(warnings) == 1
    assert "torch.float16 is not supported" in warnings[0].getMessage()


def test_unsupported_head_dim_falls_back(monkeypatch, fresh_warnings, caplog) -> None:
    monkeypatch.setattr(native, "MAX_HEAD_DIM", 8)  # fake a head_dim the kernel refuses
    with caplog.at_level(logging.WARNING):
        out, expected, calls = _run_both([(5, 1)], 2, 1, 16, 4, 8, monkeypatch)
    assert calls == 0
    torch.testing.assert_close(out, expected)
    assert "head_dim 16 is not supported" in caplog.text


def test_no_compiler_falls_back_with_a_warning(
    tmp_path, monkeypatch, fresh_warnings, caplog
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.clear_cache()
    try:
        with caplog.at_level(logging.WARNING):
            backend = CpuAttentionBackend(4, 2, 16, 0.25)
            assert backend.kernels is None
            out, expected, calls = _run_both([(7, 1)], 4, 2, 16, 4, 8, monkeypatch)
        assert "no C compiler" in caplog.text
        assert "kernels could not be built" in caplog.text
        assert calls == 0
        torch.testing.assert_close(out, expected)
    finally:
        native.clear_cache()


def test_broken_compiler_falls_back(tmp_path, monkeypatch, caplog) -> None:
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: fatal error: broken' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: str(fake_cc))
    native.clear_cache()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.load_kernels() is None
        assert "broken" in caplog.text and "falling back to PyTorch" in caplog.text
    finally:
        native.clear_cache()
