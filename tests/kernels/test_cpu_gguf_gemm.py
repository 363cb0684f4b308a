"""The GGUF block-quantized matmul (kernels/cpu/gguf_gemm.c, gguf_linear.py) and the portable
decoders (kernels/gguf_blocks.py) against the `gguf` package's own dequantizer followed by a
float matmul: every kept type, on every ISA path this machine runs (AVX2 and generic forced on
AVX-512 machines), fp32 and bf16 activations, decode row counts and a prefill-sized M, odd
multiples of the block in N and K, bias, and the dequantize-then-GEMM path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.cpu.gguf_linear import dequant_gemm, gguf_dequantize, gguf_gemm
from model_server.kernels.gguf_blocks import dequantize_rows, gguf_linear_dequant
from tests.kernels.gguf_packing import ALL_TYPES, block_shape, dequantize, quantize, random_blocks

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
ROWS = [1, 3, 4, 7, 33]
# Relative to the output's scale: fp32 differs by summation order only; bf16 rounds x and y.
REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    rel = REL[got.dtype]
    torch.testing.assert_close(got.float(), want, atol=rel * scale, rtol=rel)


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.isa == isa
    assert kernels.lib.wick_isa().decode() == isa
    return kernels


def _case(qtype: int, n: int, blocks_per_row: int, seed: int = 0):
    elems, _ = block_shape(qtype)
    k = elems * blocks_per_row
    raw = random_blocks(qtype, n, k, seed)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    return torch.from_numpy(raw), reference, k


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_portable_decoder_matches_gguf_py(qtype: int) -> None:
    blocks, reference, k = _case(qtype, 5, 3)
    got = dequantize_rows(blocks, qtype, k)
    torch.testing.assert_close(got, reference, atol=0, rtol=0)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_native_dequantize_matches_gguf_py(isa: str, qtype: int) -> None:
    kernels = _kernels(isa)
    blocks, reference, k = _case(qtype, 7, 3, seed=qtype)
    got = gguf_dequantize(blocks, qtype, k, torch.float32, kernels)
    # fp32 products of the same two factors: equal up to fma-free rounding (~1 ulp)
    torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-6)
    bf16 = gguf_dequantize(blocks, qtype, k, torch.bfloat16, kernels)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, reference.to(torch.bfloat16), atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_gemm_matches_dequantize_then_matmul(
    isa: str, qtype: int, dtype: torch.dtype
) -> None:
    kernels = _kernels(isa)
    # N odd (a thread range and the 4-row tiles end short), K an odd number of blocks
    blocks, reference, k = _case(qtype, 37, 3, seed=qtype + 1)
    gen = torch.Generator().manual_seed(qtype)
    bias = torch.randn(37, generator=gen).to(dtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(dtype)
        before = blocks.clone()
        for b in (None, bias):
            got = gguf_gemm(x, blocks, qtype, b, kernels)
            assert got.dtype == dtype and got.shape == (m, 37)
            want = F.linear(x.float(), reference, None if b is None else b.float())
            _close(got, want)
        assert torch.equal(blocks, before)  # inputs are never written


@pytest.mark.parametrize("qtype", [2, 3, 8, 12, 14])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_rows_path_and_threads(qtype: int, dtype: torch.dtype, num_threads: int) -> None:
    """dequantize-then-GEMM in chunks of W rows (N past one chunk) and the native kernel on one
    and two threads agree with the reference."""
    blocks, reference, k = _case(qtype, 1029, 2, seed=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, k, generator=gen).to(dtype)
    bias = torch.randn(1029, generator=gen).to(dtype)
    want = F.linear(x.float(), reference, bias.float())
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for got in (dequant_gemm(x, blocks, qtype, bias), gguf_gemm(x, blocks, qtype, bias)):
            _close(got, want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_quantizers_roundtrip_through_gguf_py(qtype: int) -> None:
    """The test packers (gguf_packing.py) write blocks gguf-py reads back near the input: the
    K-quant layouts are ours, so an independent decoder checks them."""
    x = np.random.default_rng(qtype).standard_normal((3, 512)).astype(np.float32)
    back = dequantize(quantize(x, qtype), qtype).reshape(3, 512)
    # error bound per format: a fraction of the block range (2-bit formats are coarse)
    bound = {10: 0.6, 11: 0.4}.get(qtype, 0.25)
    assert np.abs(back - x).max() < bound * np.abs(x).max()
    assert np.corrcoef(back.ravel(), x.ravel())[0, 1] > (0.9 if qtype in (10, 11) else 0.99)


def test_portable_linear_and_unknown_type() -> None:
    blocks, reference, k = _case(3, 6, 2)
    x = torch.randn(2, k)
    torch.testing.assert_close(gguf_linear_dequant(x, blocks, 3, None), x @ reference.T)
    with pytest.raises(ValueError, match="unsupported ggml type"):
        dequantize_rows(blocks, 99, k)
    with pytest.raises(ValueError, match="not supported"):
        gguf_gemm(x, blocks, 99, None)
