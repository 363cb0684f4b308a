"""The native skinny matmul (kernels/cpu/gemm.c, gemm.py) against F.linear on every ISA path this
machine runs (AVX2 and generic forced on AVX-512 machines), fp32 and bf16 (on avx512_bf16 both
bf16 paths: vdpbf16ps from 4 rows of x, the shift below that and where turned off), decode row
counts, odd K and N (vector and tile tails), bias, strided and non-contiguous x, the threaded
and the single-thread split, and the inputs F.linear serves instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import gemm_applies, gemm_linear

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
ROWS = [1, 2, 3, 5, 8, 13, 16]
# (K, N): K with a tail past every vector width (16 fp32 / 32 bf16 lanes) and N past the 4-row
# tiles; K shorter than a vector; one column; a multiple of everything.
SHAPES = [(577, 33), (31, 6), (1, 5), (64, 8)]
# fp32: other summation orders over K <= 2048 products of N(0, 1) values. bf16: the output's
# rounding (2^-8 relative), plus sums that land near a rounding boundary.
TOL = {torch.float32: {"atol": 2e-4, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 8e-3}}


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.isa == isa
    assert kernels.lib.wick_isa().decode() == isa  # the build really is that path
    return kernels


def _paths(isa: str) -> list[bool]:
    """The bf16 paths of a build: vdpbf16ps (only where built in) and the shift."""
    return [True, False] if isa == "avx512_bf16" else [False]


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """`got` is F.linear's result: the fp32 reference within the dtype's tolerance, and for bf16
    within one rounding step of torch's own bf16 F.linear."""
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0])
    assert got.is_contiguous()
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, **TOL[x.dtype])
    if x.dtype == torch.bfloat16:
        torch.testing.assert_close(got, F.linear(x, w, b), atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_matches_f_linear(isa: str, dtype: torch.dtype, bias: bool, k: int, n: int) -> None:
    kernels = _kernels(isa)
    assert kernels.lib.wick_gemm_has_dpbf16() == (isa == "avx512_bf16")
    for use_dpbf16 in _paths(isa) if dtype == torch.bfloat16 else [False]:
        for m in ROWS:
            x, w, b = _inputs(m, k, n, dtype, bias, seed=m)
            copies = [t.clone() for t in (x, w, b) if t is not None]
            got = gemm_linear(x, w, b, kernels=kernels, use_dpbf16=use_dpbf16)
            _check(got, x, w, b)
            # Inputs are never written.
            assert all(torch.equal(t, c) for t, c in zip([x, w, b], copies, strict=False))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_threaded_and_single_thread_splits(isa: str, dtype: torch.dtype, num_threads: int) -> None:
    """Large N on one thread and split in contiguous ranges (N = 1027: the last range ends with
    W rows short of a 4-row tile), forced either way regardless of the work size."""
    kernels = _kernels(isa)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for use_dpbf16 in _paths(isa) if dtype == torch.bfloat16 else [False]:
            for m in (1, 5, 16):
                x, w, b = _inputs(m, 96, 1027, dtype, bias=True, seed=m)
                for min_work in (0, 1 << 40):  # every thread; one thread
                    got = gemm_linear(
                        x, w, b, kernels, min_work_per_thread=min_work, use_dpbf16=use_dpbf16
                    )
                    _check(got, x, w, b)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_and_non_contiguous_x(dtype: torch.dtype) -> None:
    """Rows apart (a slice of wider rows) run in place; columns apart are copied; 3-D x keeps
    its leading dimensions; zero rows give an empty result."""
    x, w, b = _inputs(7, 40, 12, dtype, bias=True)
    wide = torch.randn(7, 64).to(dtype)
    wide[:, :40] = x
    sliced = wide[:, :40]
    assert sliced.stride() == (64, 1)
    _check(gemm_linear(sliced, w, b), x, w, b)
    transposed = x.t().contiguous().t()
    assert transposed.stride() == (1, 7)
    _check(gemm_linear(transposed, w, b), x, w, b)
    x3 = x[:6].reshape(2, 3, 40)
    _check(gemm_linear(x3, w, b), x3, w, b)
    assert gemm_linear(x[:0], w, b).shape == (0, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_propagates(dtype: torch.dtype) -> None:
    """A NaN in a row of x makes that row's outputs NaN (bf16: the rounding keeps it NaN), the
    other rows untouched."""
    x, w, b = _inputs(5, 40, 9, dtype, bias=True)
    x[2, 7] = float("nan")
    got = gemm_linear(x, w, b)
    assert torch.isnan(got[2]).all()
    keep = [0, 1, 3, 4]
    _check(got[keep], x[keep], w, b)


def test_f_linear_serves_what_the_kernel_does_not_run() -> None:
    """fp16, mixed dtypes and a non-contiguous weight go to F.linear (same result, same
    errors); `gemm_applies` says which weights the kernel runs."""
    x16, w16, b16 = _inputs(3, 32, 8, torch.float16, bias=True)
    assert not gemm_applies(w16)
    torch.testing.assert_close(gemm_linear(x16, w16, b16), F.linear(x16, w16, b16))
    x, w, _ = _inputs(3, 32, 8, torch.float32, bias=False)
    w_t = torch.randn(32, 8).t()  # [8, 32], not contiguous
    assert not gemm_applies(w_t) and gemm_applies(w)
    torch.testing.assert_close(gemm_linear(x, w_t), F.linear(x, w_t))
    with pytest.raises(RuntimeError):  # F.linear's own error for mixed dtypes
        gemm_linear(x, w.bfloat16())
