"""The CPU kernel table's mixture-of-experts slots on kernels/cpu/moe.c (kernels/cpu/moe.py)
against the portable PyTorch ones (kernels/fused_moe_torch.py): routing, grouped experts and
Qwen2-MoE's shared expert add, in fp32 and bf16, on random experts and routings (experts that
get no token, one that gets most, a decode's single row, top-1 to top-3). The native decoder
step runs these same C functions (tests/kernels/test_native_step_families.py: its MoE families
give the modules' bits)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model_server.kernels.cpu.experts_plan import pack_experts, plan_experts
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.moe import (
    native_fused_experts,
    native_shared_expert_add,
    native_softmax_topk,
)
from model_server.kernels.fused_moe_torch import (
    fused_experts_grouped,
    shared_expert_add,
    softmax_topk,
)
from model_server.kernels.table import TORCH_KERNELS

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

E, H, INTER = 6, 64, 48
# fp32: the sums run in another order; bf16: a product rounds to bf16 before it is summed, as
# PyTorch's, but the matmuls accumulate in another order (one bf16 ulp of the outputs).
TOLERANCES = {torch.float32: (2e-6, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.1).to(dtype)
    logits = torch.randn(num_tokens, E, generator=gen)
    if skew:  # expert 2 wins almost everywhere, experts 4 and 5 never
        logits[:, 2] += 4.0
        logits[:, 4:] -= 10.0
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    return x, w13, w2, logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_routing_chooses_pytorchs_experts_and_weights(
    dtype: torch.dtype, renormalize: bool, top_k: int
) -> None:
    kernels = default_kernels()
    _, _, _, logits = _case(33, top_k, dtype, seed=top_k)
    weights, ids = native_softmax_topk(kernels, logits, top_k, renormalize)
    ref_weights, ref_ids = softmax_topk(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # best first, as torch.topk sorts them
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33), atol=1e-6, rtol=0)


def test_routing_breaks_ties_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0, 0.0]])
    weights, ids = native_softmax_topk(default_kernels(), logits, 2, True)
    assert ids.tolist() == [[1, 2]]
    assert weights.tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "skew"), [(1, 2, False), (7, 2, False), (19, 3, True), (5, 1, True)]
)
def test_grouped_experts_match_the_pytorch_path(
    dtype: torch.dtype, num_tokens: int, top_k: int, skew: bool
) -> None:
    x, w13, w2, logits = _case(num_tokens, top_k, dtype, seed=num_tokens, skew=skew)
    weights, ids = softmax_topk(logits, top_k, True)
    out = native_fused_experts(default_kernels(), x, w13, w2, weights, ids, TORCH_KERNELS)
    ref = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    assert out.abs().max() > 0.05  # not a zero that would pass anything
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_slices_sum_to_the_whole_experts(dtype: torch.dtype, tp: int) -> None:
    """Each rank's experts as FusedMoE slices them (gate and up rows, down columns, at
    r * I / tp): moe.c's partial outputs, summed as the all-reduce sums them, are the whole
    experts' output (the native step's MoE layers under tensor parallelism)."""
    x, w13, w2, logits = _case(13, 2, dtype, seed=tp, skew=True)
    weights, ids = softmax_topk(logits, 2, True)
    part = INTER // tp
    total = torch.zeros(x.shape[0], H, dtype=torch.float32)
    for r in range(tp):
        rows = slice(r * part, (r + 1) * part)
        gate, up = w13[:, :INTER][:, rows], w13[:, INTER:][:, rows]
        w13_r = torch.cat([gate, up], dim=1).contiguous()
        w2_r = w2[:, :, rows].contiguous()
        out = native_fused_experts(default_kernels(), x, w13_r, w2_r, weights, ids, TORCH_KERNELS)
        ref = fused_experts_grouped(x, w13_r, w2_r, weights, ids, TORCH_KERNELS)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)  # a rank's own slice
        total += out.float()
    whole = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS).float()
    assert whole.abs().max() > 0.05
    # fp32: the partial sums' order; bf16: each rank's output rounds before the sum
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(total, whole, atol=atol, rtol=atol)


def _laid_out(w13: torch.Tensor, w2: torch.Tensor, layout: str) -> tuple[Any, Any]:
    """The experts as loaded ("stacked") or packed by the experts' plan ("panels")."""
    if layout == "stacked":
        return w13, w2
    kernels = default_kernels()
    plan = plan_experts(w13.dtype, kernels)
    return pack_experts(w13, plan, kernels), pack_experts(w2, plan, kernels)


@pytest.mark.parametrize("layout", ["stacked", "panels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_bits_do_not_depend_on_the_thread_count(
    dtype: torch.dtype, layout: str
) -> None:
    """The native step and the modules may run a step on different thread counts' splits (a
    small matmul stays on one thread): each output is computed whole by one thread."""
    x, w13, w2, logits = _case(24, 2, dtype, seed=5)
    w13, w2 = _laid_out(w13, w2, layout)
    weights, ids = softmax_topk(logits, 2, False)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                native_fused_experts(default_kernels(), x, w13, w2, weights, ids, TORCH_KERNELS)
            )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("layout", ["stacked", "panels"])
def test_an_expert_id_out_of_range_is_refused(layout: str) -> None:
    x, w13, w2, logits = _case(3, 2, torch.float32, seed=1)
    w13, w2 = _laid_out(w13, w2, layout)
    weights, ids = softmax_topk(logits, 2, True)
    ids[1, 0] = E
    with pytest.raises(IndexError, match="expert id"):
        native_fused_experts(default_kernels(), x, w13, w2, weights, ids, TORCH_KERNELS)


def test_other_dtypes_run_the_pytorch_path() -> None:
    x, w13, w2, logits = _case(4, 2, torch.float16, seed=2)
    weights, ids = softmax_topk(logits, 2, True)
    out = native_fused_experts(default_kernels(), x, w13, w2, weights, ids, TORCH_KERNELS)
    assert torch.equal(out, fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_expert_add_rounds_as_pytorch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    routed, shared = (torch.randn(9, H, generator=gen).to(dtype) for _ in range(2))
    gate = (torch.randn(9, 1, generator=gen) * 3).to(dtype)
    out = native_shared_expert_add(default_kernels(), routed, gate, shared)
    ref = shared_expert_add(routed, gate, shared)
    assert out.dtype == dtype
    # Each op rounded to the dtype as PyTorch's: libm's expf and PyTorch's vectorised sigmoid
    # may differ in the last fp32 bit, which a bf16 rounding almost never shows.
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert not torch.equal(out, routed)
