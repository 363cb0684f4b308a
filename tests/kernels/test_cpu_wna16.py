"""The wNa16 matmuls of GPTQ/AWQ weights (kernels/cpu/wna16_gemm.c, kernels/cpu/wna16.py) against
dequantize-then-matmul (kernels/portable.py) on every ISA path this machine runs (AVX2 and
generic forced on AVX-512 machines), 4 and 8 bits, group sizes 32 / 128 / per-channel, fp32 and
bf16 activations, decode row counts past the register tiles, N past the 4-row tiles, bias, and
threaded splits; plus the blocked dequantizing matmul for big row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.cpu.wna16 import (
    wna16_dequantized_linear,
    wna16_linear,
    wna16_native_linear,
)
from model_server.kernels.portable import (
    dequantize_wna16,
    pack_int4,
    unpack_int4,
    wna16_linear_dequant,
)

RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
ROWS = [1, 2, 3, 5, 8, 17]
# fp32: summation order over K <= 512 products; bf16: the output's rounding (2^-8 relative).
TOL = {torch.float32: {"atol": 1e-3, "rtol": 1e-4}, torch.bfloat16: {"atol": 5e-2, "rtol": 1e-2}}


def _weight(n: int, k: int, bits: int, group_size: int, seed: int = 0):
    """Random codes, scales and offsets in the wNa16 layout (group_size -1: per channel)."""
    gen = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // gs, generator=gen) * 0.02 + 0.001
    offsets = -scales * torch.randint(0, 1 << bits, (n, k // gs), generator=gen).float()
    codes = pack_int4(q) if bits == 4 else q
    return q, codes, scales, offsets, gs


def test_int4_layout_round_trips_and_places_nibbles() -> None:
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    codes = pack_int4(q)
    assert codes.shape == (3, 32) and codes.dtype == torch.uint8
    assert torch.equal(unpack_int4(codes), q)
    # Byte j of a 32-block: k = j low nibble, k = 16 + j high nibble.
    assert int(codes[1, 5]) == int(q[1, 5]) | (int(q[1, 21]) << 4)
    assert int(codes[2, 16 + 3]) == int(q[2, 32 + 3]) | (int(q[2, 48 + 3]) << 4)


def test_dequantize_is_scale_times_code_plus_offset() -> None:
    q, codes, scales, offsets, gs = _weight(8, 64, 4, 32)
    w = dequantize_wna16(codes, scales, offsets, 4, gs)
    g = torch.arange(64) // 32
    torch.testing.assert_close(w, scales[:, g] * q.float() + offsets[:, g])


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.isa == isa
    assert kernels.lib.wick_isa().decode() == isa
    return kernels


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("group_size", "k", "n"), [(32, 96, 37), (128, 256, 8), (-1, 64, 5)])
def test_native_matches_dequantize_then_matmul(
    isa: str, dtype: torch.dtype, bits: int, group_size: int, k: int, n: int
) -> None:
    kernels = _kernels(isa)
    _, codes, scales, offsets, gs = _weight(n, k, bits, group_size, seed=bits)
    gen = torch.Generator().manual_seed(1)
    for bias in (None, torch.randn(n, generator=gen).to(dtype)):
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(dtype)
            copies = [t.clone() for t in (x, codes, scales, offsets)]
            got = wna16_native_linear(x, codes, scales, offsets, bits, gs, bias, kernels=kernels)
            assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
            w = dequantize_wna16(codes, scales, offsets, bits, gs)
            want = F.linear(x.float(), w, None if bias is None else bias.float())
            tol = dict(TOL[dtype])
            if dtype == torch.bfloat16:
                # More rows than a tile on AVX512-BF16 run vdpbf16ps on W rounded to bf16
                # (2^-9 per weight, summed over K): within 1 % of the output's scale.
                tol["atol"] = max(tol["atol"], 1e-2 * float(want.abs().max()))
            torch.testing.assert_close(got.float(), want, **tol)
            assert all(
                torch.equal(t, c) for t, c in zip((x, codes, scales, offsets), copies, strict=True)
            )


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_threaded_splits(isa: str, num_threads: int) -> None:
    kernels = _kernels(isa)
    _, codes, scales, offsets, gs = _weight(1027, 128, 4, 64)
    x = torch.randn(3, 128)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = wna16_native_linear(
            x, codes, scales, offsets, 4, gs, kernels=kernels, min_work_per_thread=0
        )
    finally:
        torch.set_num_threads(previous)
    want = wna16_linear_dequant(x, codes, scales, offsets, 4, gs, None)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_strided_x_rows() -> None:
    _, codes, scales, offsets, gs = _weight(16, 64, 8, 32)
    wide = torch.randn(4, 100)
    x = wide[:, 10:74]  # rows 100 apart
    got = wna16_native_linear(x, codes, scales, offsets, 8, gs)
    torch.testing.assert_close(
        got,
        wna16_linear_dequant(x.contiguous(), codes, scales, offsets, 8, gs, None),
        **TOL[torch.float32],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocked_dequantize_and_fixed_choice(monkeypatch, dtype: torch.dtype) -> None:
    # Blocks of 3 rows of W (of 40, the last one partial): each lands in its own columns.
    monkeypatch.setattr("model_server.kernels.cpu.wna16._BLOCK_BYTES", 3 * 64 * 4)
    _, codes, scales, offsets, gs = _weight(40, 64, 4, 32)
    x = torch.randn(50, 64).to(dtype)
    bias = torch.randn(40).to(dtype)
    want = wna16_linear_dequant(x.float(), codes, scales, offsets, 4, gs, bias.float())
    for fn in (wna16_dequantized_linear, wna16_linear):
        got = fn(x, codes, scales, offsets, 4, gs, bias)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_fp16_activations_take_the_dequantizing_path() -> None:
    _, codes, scales, offsets, gs = _weight(8, 64, 4, 32)
    x = torch.randn(2, 64).half()
    got = wna16_native_linear(x, codes, scales, offsets, 4, gs)
    assert got.dtype == torch.float16
    torch.testing.assert_close(
        got.float(),
        wna16_linear_dequant(x.float(), codes, scales, offsets, 4, gs, None),
        atol=1e-2,
        rtol=1e-2,
    )
