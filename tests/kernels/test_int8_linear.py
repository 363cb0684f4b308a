"""The w8a16 Triton kernel (kernels/int8_linear.py) against the dequantized matmul, and a tiny
model whose linear layers run through it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model_server.kernels.int8_linear import int8_linear
from model_server.kernels.portable import int8_linear_dequant
from model_server.layers.quantization import Int8Weight, quantize_int8
from model_server.platforms.cpu import CpuPlatform
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, tiny_llm, use_kernels

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 96, 64), (5, 33, 40), (16, 64, 300), (17, 70, 64), (70, 130, 48)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_the_dequantized_matmul(device, m, n, k, with_bias) -> None:
    torch.manual_seed(m * n + k)
    q = quantize_int8(torch.randn(n, k))
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device) if with_bias else None
    qweight, scale = q.qweight.to(device), q.scale.to(device)
    got = int8_linear(x, qweight, scale, bias)
    expected = F.linear(x, q.dequantize().to(device), bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_half_precision(device, dtype) -> None:
    torch.manual_seed(0)
    q = quantize_int8(torch.randn(64, 96))
    x = torch.randn(8, 96, device=device).to(dtype)
    got = int8_linear(x, q.qweight.to(device), q.scale.to(device))
    expected = F.linear(x.float(), q.dequantize().to(device))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=5e-2)


def test_int8_linear_rejects_mismatched_shapes() -> None:
    q = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="do not match"):
        int8_linear(torch.randn(2, 15), q.qweight, q.scale)


def test_tiny_model_greedy_output_with_the_triton_int8_kernel(tmp_path, monkeypatch) -> None:
    """The same int8 model decodes the same greedy tokens with the Triton kernel as with the
    exact dequantized matmul (CUDA's table has the kernel; here the CPU platform's is given it,
    under the interpreter)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # CUDA's layout (the CPU's own holds -q int8 as wNa16 codes where its native kernels built).
    monkeypatch.setattr(CpuPlatform, "int8_weights_layout", lambda self, options: "int8")
    outputs = []
    for kernel in (int8_linear_dequant, int8_linear):
        use_kernels(monkeypatch, lambda table, kernel=kernel: replace(table, int8_linear=kernel))
        llm = tiny_llm(tmp_path, "llama-gqa", quantization="int8")
        model = llm.engine.core.model_runner.model
        assert sum(isinstance(m, Int8Weight) for m in model.modules()) >= 5  # layers + LM head
        assert model.lm_head.kernels.int8_linear is kernel
        outputs.append([o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)])
    expected, got = outputs
    assert got == expected
