"""GPTQ / AWQ experts kept in their codes on kernels/cpu/moe_wna16.c (kernels/cpu/moe_wna16.py,
the CPU table's `fused_experts` on `WNA16Experts`) against the module path's grouped experts
(kernels/fused_moe_torch.py): each expert's matmul the table's `wna16_linear`, here the native
wNa16 kernel, which gives the same bits; and against the float experts of the dequantized
weights (PyTorch's matmuls: float rounding). Row counts 1 (decode), 3, 16 and 40 (prefill: an
expert gets a dozen rows or more), 4 and 8 bits, group sizes 32, 64, 128 and per channel, fp32
and bf16. The native decoder step runs this same C function (tests/kernels/
test_native_step_families.py: GPTQ MoE models give the modules' bits)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.layer_ops import native_kernel_table
from model_server.kernels.cpu.moe import native_fused_experts
from model_server.kernels.cpu.moe_wna16 import experts_reason, native_wna16_experts
from model_server.kernels.cpu.wna16 import wna16_native_linear
from model_server.kernels.fused_moe_torch import fused_experts_grouped, softmax_topk
from model_server.kernels.portable import pack_int4
from model_server.kernels.table import TORCH_KERNELS
from model_server.layers.quantization.wna16_moe import WNA16Experts

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

E, H, INTER = 6, 128, 64


def _experts(gen: torch.Generator, n: int, k: int, bits: int, group_size: int) -> WNA16Experts:
    q = torch.randint(0, 1 << bits, (E, n, k), generator=gen, dtype=torch.uint8)
    groups = -(-k // group_size)
    # weights within about +-0.16 whatever the bits
    scales = (torch.rand(E, n, groups, generator=gen) * 0.02 + 0.001) * 16 / (1 << bits)
    offsets = -scales * (1 << (bits - 1)) + torch.randn(E, n, groups, generator=gen) * 1e-3
    codes = torch.stack([pack_int4(q[e]) for e in range(E)]) if bits == 4 else q
    return WNA16Experts("gptq", bits, group_size, codes, scales, offsets, None)


def _case(num_tokens: int, top_k: int, bits: int, group_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = _experts(gen, 2 * INTER, H, bits, group_size or H)
    w2 = _experts(gen, H, INTER, bits, group_size or INTER)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, 1] += 1.5  # expert 1 gets most rows, and some expert likely none
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    weights, ids = softmax_topk(logits, top_k, True)
    return x, w13, w2, weights, ids


def _module_table():
    """The module path's table for these experts: the native wNa16 matmul per expert (the
    fixed choice up to 32 rows) and the native SiLU-and-mul."""
    return replace(
        native_kernel_table(default_kernels(), TORCH_KERNELS), wna16_linear=wna16_native_linear
    )


def _assert_near_the_float_experts(out, x, w13, w2, weights, ids) -> None:
    """The float experts of the same weights in fp32 on PyTorch's matmuls: float rounding apart
    (bf16: the activations and the matmuls' outputs round to bf16 on the way)."""
    ref = fused_experts_grouped(
        x.float(), w13.dequantize(), w2.dequantize(), weights, ids, TORCH_KERNELS
    )
    error = (out.float() - ref).norm() / ref.norm()
    assert error < (1e-5 if x.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (4, 0), (8, 128)])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40])
def test_the_experts_give_the_module_paths_bits(
    dtype: torch.dtype, bits: int, group_size: int, num_tokens: int
) -> None:
    top_k = 2 if num_tokens != 3 else 3
    x, w13, w2, weights, ids = _case(num_tokens, top_k, bits, group_size, dtype, num_tokens)
    out = native_wna16_experts(default_kernels(), x, w13, w2, weights, ids)
    assert out is not None and out.dtype == dtype and out.shape == (num_tokens, H)
    assert out.abs().max() > 0.05  # not a zero that would pass anything
    modules = fused_experts_grouped(x, w13, w2, weights, ids, _module_table())
    assert torch.equal(out, modules)
    _assert_near_the_float_experts(out, x, w13, w2, weights, ids)


def test_the_cpu_tables_fused_experts_runs_them() -> None:
    x, w13, w2, weights, ids = _case(5, 2, 4, 32, torch.float32, seed=9)
    out = native_fused_experts(default_kernels(), x, w13, w2, weights, ids, TORCH_KERNELS)
    assert torch.equal(out, native_wna16_experts(default_kernels(), x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bits_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids = _case(24, 2, 4, 32, dtype, seed=5)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(native_wna16_experts(default_kernels(), x, w13, w2, weights, ids))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 12])
def test_act_order_experts_give_the_module_paths_bits(dtype: torch.dtype, num_tokens: int):
    """Act-order experts (each expert's codes stored in its own order of the input features,
    w13's of the hidden dim, w2's of the intermediate one): moe_wna16.c gathers each expert's
    input columns in that order, as the module path's index_select does before its matmul."""
    x, w13, w2, weights, ids = _case(num_tokens, 2, 4, 32, dtype, seed=2)

    def perms(k: int, seed: int) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(seed + e) for e in range(E)]
        return torch.stack([torch.randperm(k, generator=g) for g in gens])

    w13 = WNA16Experts("gptq", 4, 32, w13.codes, w13.scales, w13.offsets, perms(H, 0))
    w2 = WNA16Experts("gptq", 4, 32, w2.codes, w2.scales, w2.offsets, perms(INTER, 100))
    assert experts_reason(w13, w2, dtype) is None
    out = native_wna16_experts(default_kernels(), x, w13, w2, weights, ids)
    assert out is not None and out.abs().max() > 0.05
    modules = fused_experts_grouped(x, w13, w2, weights, ids, _module_table())
    assert torch.equal(out, modules)
    _assert_near_the_float_experts(out, x, w13, w2, weights, ids)
    # the order matters: the same codes read in input order give another result
    plain = WNA16Experts("gptq", 4, 32, w13.codes, w13.scales, w13.offsets, None)
    assert not torch.equal(native_wna16_experts(default_kernels(), x, plain, w2, weights, ids), out)
    wrong = WNA16Experts("gptq", 4, 32, w13.codes, w13.scales, w13.offsets, w13.perm.int())
    assert experts_reason(wrong, w2, dtype) == (
        "act-order w13 experts whose perm is not a contiguous CPU int64 tensor"
    )


def test_what_the_kernel_does_not_take_is_named() -> None:
    _, w13, w2, _, _ = _case(1, 2, 4, 32, torch.float32, seed=1)
    assert experts_reason(w13, w2, torch.float32) is None
    assert experts_reason(w13, w2, torch.float16) == (
        "torch.float16 activations (native: float32, bfloat16)"
    )
    assert experts_reason(w13, w13, torch.float32) == "experts of mismatched shapes"
    assert experts_reason(object(), w2, torch.float32) == (
        "experts kept as object (native: float or GPTQ/AWQ codes)"
    )
    odd = WNA16Experts("awq", 4, 48, w13.codes, w13.scales, w13.offsets, None)
    assert experts_reason(odd, w2, torch.float32) == (
        "w13 experts of 4 bits, group 48, K 128 (native: 4 or 8 bits, group size and K "
        "multiples of 32)"
    )


def test_an_expert_id_out_of_range_is_refused() -> None:
    x, w13, w2, weights, ids = _case(3, 2, 4, 32, torch.float32, seed=1)
    ids[1, 0] = E
    with pytest.raises(IndexError, match="expert id"):
        native_wna16_experts(default_kernels(), x, w13, w2, weights, ids)
