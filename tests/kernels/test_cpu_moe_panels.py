"""The experts' plan (kernels/cpu/experts_plan.py): stacked float experts packed into panels
(`PanelExperts`, in place of the stacked tensors) and run by moe.c's wick_moe_panel_experts,
against the portable PyTorch path; the holder keeps the values (state_dict, `dequantize`).
tests/kernels/test_cpu_moe.py runs its thread-count and expert-id checks on both layouts, and
tests/kernels/test_native_step_families.py checks that the native step gives the modules' bits
on MoE models whose experts the preparation packed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_server.kernels.cpu.experts_plan import (
    PANEL_MIN_ROWS,
    ExpertsPlan,
    PanelExperts,
    install_expert_panels,
    plan_experts,
)
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.layer_ops import silu_and_mul
from model_server.kernels.cpu.moe import native_fused_experts
from model_server.kernels.cpu.panel_gemm import Panels, pairs_available, panel_linear
from model_server.kernels.fused_moe_torch import fused_experts_grouped, softmax_topk
from model_server.kernels.table import TORCH_KERNELS
from tests.kernels.test_cpu_moe import TOLERANCES, _laid_out

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

E, H, INTER = 6, 64, 48
# 48: the gate/up matmul and SiLU run fused (a multiple of every panel width); 36: apart.
INTERS = [48, 36]
DTYPES = [torch.float32, torch.bfloat16]


def _experts(
    dtype: torch.dtype, seed: int = 0, inter: int = INTER
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) * 0.1).to(dtype)
    return w13, w2


def _routing(num_tokens: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, 2] += 3.0  # expert 2 gets most tokens, the others a few or none
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    weights, ids = softmax_topk(logits, top_k, True)
    return x, weights, ids


def _packed(w13: torch.Tensor, w2: torch.Tensor) -> tuple[PanelExperts, PanelExperts]:
    return _laid_out(w13, w2, "panels")


def test_the_plan_packs_where_the_panels_win_at_every_row_count() -> None:
    kernels = default_kernels()
    fp32 = plan_experts(torch.float32, kernels)
    assert (fp32.layout, fp32.pairs) == ("panels", False)
    bf16 = plan_experts(torch.bfloat16, kernels)
    pairs = pairs_available(kernels)
    assert bf16.pairs == pairs
    assert bf16.layout == (
        "panels" if PANEL_MIN_ROWS.get((torch.bfloat16, pairs)) == 1 else "stacked"
    )
    assert plan_experts(torch.float16, kernels).layout == "stacked"
    assert plan_experts(torch.float32, None).layout == "stacked"


@pytest.mark.parametrize("inter", INTERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (1, 2), (5, 2), (40, 3)])
def test_panel_experts_match_the_pytorch_path(
    dtype: torch.dtype, num_tokens: int, top_k: int, inter: int
) -> None:
    w13, w2 = _experts(dtype, inter=inter)
    p13, p2 = _packed(w13, w2)
    x, weights, ids = _routing(num_tokens, top_k, dtype, seed=num_tokens)
    out = native_fused_experts(default_kernels(), x, p13, p2, weights, ids, TORCH_KERNELS)
    ref = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    assert out.abs().max() > 0.05
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("inter", INTERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_experts_are_the_bits_of_each_experts_panel_matmuls(
    dtype: torch.dtype, inter: int
) -> None:
    """Each pair's expert run as the dense layers run panels (panel_linear, layer_ops.c's SiLU
    and mul, panel_linear), weighted and summed over the slots in order in fp32, rounded once:
    the fused gate/up SiLU (inter 48) and the separate one (36) give these bits."""
    kernels = default_kernels()
    w13, w2 = _experts(dtype, seed=3, inter=inter)
    p13, p2 = _packed(w13, w2)
    x, weights, ids = _routing(9, 2, dtype, seed=9)
    out = native_fused_experts(kernels, x, p13, p2, weights, ids, TORCH_KERNELS)
    want = torch.empty_like(out)
    for t in range(x.shape[0]):
        acc = torch.zeros(H, dtype=torch.float32)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            up = Panels(p13.panels[e], p13.n, p13.k, p13.pairs)
            down = Panels(p2.panels[e], p2.n, p2.k, p2.pairs)
            mid = silu_and_mul(kernels, panel_linear(x[t : t + 1], up, kernels=kernels))
            acc += panel_linear(mid, down, kernels=kernels)[0].float() * weights[t, j]
        want[t] = acc.to(dtype)
    assert out.abs().max() > 0.05
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_output_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """One kernel whatever an expert's row count, and a row-invariant one: a token computed in
    a batch of 40 (expert 2 gets most of them) is the bits of the token alone."""
    w13, w2 = _experts(dtype, seed=1)
    p13, p2 = _packed(w13, w2)
    x, weights, ids = _routing(40, 2, dtype, seed=7)
    batch = native_fused_experts(default_kernels(), x, p13, p2, weights, ids, TORCH_KERNELS)
    for t in (0, 17, 39):
        alone = native_fused_experts(
            default_kernels(), x[t : t + 1], p13, p2, weights[t : t + 1], ids[t : t + 1],
            TORCH_KERNELS,
        )  # fmt: skip
        assert torch.equal(alone[0], batch[t])


def test_activations_of_another_dtype_run_the_stacked_values() -> None:
    w13, w2 = _experts(torch.float32)
    p13, p2 = _packed(w13, w2)
    x, weights, ids = _routing(4, 2, torch.float64, seed=3)
    out = native_fused_experts(default_kernels(), x, p13, p2, weights, ids, TORCH_KERNELS)
    ref = fused_experts_grouped(x, w13.double(), w2.double(), weights, ids, TORCH_KERNELS)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref)


class _Experts(nn.Module):
    """FusedMoE's float weights, as the preparation finds them."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        w13, w2 = _experts(dtype, seed=4)
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_panels_replace_the_stacked_weights_and_keep_their_values(dtype: torch.dtype) -> None:
    model = nn.Sequential(_Experts(dtype), nn.Linear(4, 4))
    w13, w2 = model[0].w13_weight.detach().clone(), model[0].w2_weight.detach().clone()
    kernels = default_kernels()
    plan = ExpertsPlan(dtype, "panels", dtype == torch.bfloat16 and pairs_available(), "test")
    assert install_expert_panels(model, plan, kernels) == 1
    experts = model[0]
    assert isinstance(experts.w13_weight, PanelExperts)
    assert isinstance(experts.w2_weight, PanelExperts)
    assert experts.w13_weight.shape == w13.shape and experts.w2_weight.shape == w2.shape
    # The stacked tensors are gone: the state holds the panels only (a panel's padding aside).
    state = model.state_dict()
    assert "0.w13_weight" not in state and "0.w13_weight.panels" in state
    packed = sum(v.numel() for k, v in state.items() if k.startswith("0."))
    assert w13.numel() + w2.numel() <= packed < 1.1 * (w13.numel() + w2.numel())
    assert torch.equal(experts.w13_weight.dequantize(), w13)
    assert torch.equal(experts.w2_weight.dequantize(), w2)
    # A stacked plan, or experts of another dtype, change nothing.
    other = nn.Sequential(_Experts(dtype))
    assert install_expert_panels(other, ExpertsPlan(dtype, "stacked", False, ""), kernels) == 0
    wrong = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert install_expert_panels(other, ExpertsPlan(wrong, "panels", False, ""), kernels) == 0
    assert isinstance(other[0].w13_weight, nn.Parameter)
