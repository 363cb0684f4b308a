"""GPTQ and AWQ tensors repacked into the wNa16 layout (layers/quantization/wna16.py): the
dequantized weight equals the format's reference decoding (tests/layers/quantization/
checkpoints.py, code by code from the spec) for every supported variant, is within half a
quantization step of the float weight, and the matmul through each kernel table matches it;
quantization_config fields the kernels cannot serve are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.linear import dense
from model_server.layers.quantization.wna16 import WNA16Config, WNA16Weight, repack
from model_server.layers.quantization.wna16_pack import quantize_groups
from model_server.platforms.cpu import CpuPlatform
from tests.layers.quantization.checkpoints import Format, quantize_layer, reference_dequantize

FORMATS = [
    Format("gptq", 4, 32),
    Format("gptq", 4, 64, sym=False),
    Format("gptq", 4, 128, desc_act=True),
    Format("gptq", 4, -1),
    Format("gptq", 8, 32),
    Format("gptq", 8, 128, sym=False, desc_act=True),
    Format("gptq", 8, -1, sym=False),
    Format("gptq", 4, 32, sym=False, v2=True),
    Format("awq", 4, 32),
    Format("awq", 4, 128),
]


def _repacked(fmt: Format, w: torch.Tensor, seed: int = 0) -> tuple[WNA16Weight, dict]:
    tensors = quantize_layer(w, fmt, seed)
    config = WNA16Config.from_quantization_config(fmt.config())
    g_idx = tensors.get("g_idx")
    return repack(config, tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx), tensors


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_repacked_weight_is_the_reference_decoding(fmt: Format) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    weight, tensors = _repacked(fmt, w)
    assert weight.shape == (48, 256) and weight.bits == fmt.bits
    assert weight.codes.dtype == torch.uint8
    assert weight.codes.shape == (48, 256 * fmt.bits // 8)
    assert (weight.perm is not None) == fmt.desc_act
    reference = reference_dequantize(tensors, fmt, 256)
    torch.testing.assert_close(weight.dequantize(), reference, atol=1e-6, rtol=1e-5)
    # Round to nearest: within a step (the group's scale) of the float weight (half a step
    # but where the symmetric range clips the group's largest value).
    step = tensors["scales"].float().amax()
    assert (weight.dequantize() - w).abs().max() <= step + 1e-6


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dense_through_each_kernel_table(fmt: Format) -> None:
    torch.manual_seed(1)
    weight, _ = _repacked(fmt, torch.randn(40, 256) * 0.05)
    cpu = CpuPlatform().kernel_table()
    for rows in (1, 3, 40):
        x = torch.randn(2, rows, 256)
        bias = torch.randn(40)
        want = x @ weight.dequantize().t() + bias
        for kernels in (TORCH_KERNELS, cpu):
            got = dense(x, weight, bias, kernels=kernels)
            assert got.shape == (2, rows, 40)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        got = dense(x.bfloat16(), weight, bias.bfloat16(), kernels=cpu)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)


def test_symmetric_codes_centre_on_the_zero_point() -> None:
    w = torch.tensor([[-1.0, 0.5, 1.0, 0.0] * 8])
    q, _, zeros = quantize_groups(w, 4, 32, sym=True)
    assert int(zeros[0, 0]) == 8
    assert q.min() >= 0 and q.max() <= 15
    assert int(q[0, 3]) == 8  # 0.0 is the zero point


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, r"group_size 48 is not supported"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"bits 8 is not supported for awq"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            r"version 'gemv'",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"checkpoint_format 'marlin'",
        ),
        ({"quant_method": "fp8"}, r"quant_method 'fp8' is not supported"),
    ],
)
def test_unsupported_configs_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WNA16Config.from_quantization_config(fields)


def test_descriptions() -> None:
    parse = WNA16Config.from_quantization_config
    assert parse({"quant_method": "gptq", "bits": 4, "group_size": 128}).description == (
        "gptq w4 g128"
    )
    gptq8 = parse({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True})
    assert gptq8.description == "gptq w8 per-channel act-order"
    assert gptq8.zeros_minus_one
    awq = parse({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "GEMM"})
    assert awq.description == "awq w4 g64" and not awq.zeros_minus_one


def test_bad_g_idx_is_refused() -> None:
    fmt = Format("gptq", 4, 32)
    tensors = quantize_layer(torch.randn(8, 64), fmt, 0)
    config = WNA16Config.from_quantization_config(fmt.config())
    g_idx = torch.zeros(64, dtype=torch.int32)  # one group of 64 where groups hold 32
    with pytest.raises(ValueError, match="g_idx: every group must hold 32"):
        repack(config, tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx)


def test_portable_table_is_the_default() -> None:
    assert KernelTable().wna16_linear is TORCH_KERNELS.wna16_linear
