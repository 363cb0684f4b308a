"""The w4a16 / w8a16 Triton kernel of GPTQ/AWQ weights (kernels/wna16_linear.py) against
dequantize-then-matmul (kernels/portable.py), under the Triton interpreter on CPU: both bit
widths, group sizes that split K into several groups, a short last group, per-channel, bias,
decode and prefill tile shapes, half-precision activations."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.portable import pack_int4, wna16_linear_dequant
from model_server.kernels.wna16_linear import wna16_linear

pytestmark = pytest.mark.kernels


def _weight(n: int, k: int, bits: int, group_size: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    offsets = -scales * torch.randint(0, 1 << bits, (n, groups), generator=gen).float()
    codes = pack_int4(q) if bits == 4 else q
    return codes.to(device), scales.to(device), offsets.to(device), gs


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("m", "n", "k", "group_size"),
    [(1, 40, 128, 32), (5, 33, 256, 128), (17, 64, 96, 64), (3, 8, 64, -1), (20, 24, 160, 128)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_dequantize_then_matmul(device, bits, m, n, k, group_size, with_bias) -> None:
    codes, scales, offsets, gs = _weight(n, k, bits, group_size, device, seed=m + n)
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device) if with_bias else None
    got = wna16_linear(x, codes, scales, offsets, bits, gs, bias)
    want = wna16_linear_dequant(x, codes, scales, offsets, bits, gs, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(device, dtype) -> None:
    codes, scales, offsets, gs = _weight(48, 128, 4, 32, device)
    x = torch.randn(4, 128, device=device).to(dtype)
    got = wna16_linear(x, codes, scales, offsets, 4, gs)
    want = wna16_linear_dequant(x.float(), codes, scales, offsets, 4, gs, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)


def test_mismatched_codes_are_refused() -> None:
    codes, scales, offsets, gs = _weight(8, 64, 4, 32, "cpu")
    with pytest.raises(ValueError, match="do not match"):
        wna16_linear(torch.randn(2, 96), codes, scales, offsets, 4, gs)
