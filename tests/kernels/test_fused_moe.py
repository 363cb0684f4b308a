"""The mixture-of-experts expert kernels: the grouped PyTorch path (CPU), its naive per-token
reference, transformers' own expert loop, and the Triton grouped-GEMM kernel (under
TRITON_INTERPRET=1 on CPUs), on the same random experts and routings.

Routings include experts that get no token, one that gets most of them, and T = 1 (a decode).
GPTQ/AWQ experts kept quantized run on the triton table per expert through its wNa16 kernel.
fp32 results agree to fp32 rounding (the sums run in another order); the Triton kernel's
alignment puts every pair in exactly one padded tile of its own expert.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from model_server.kernels.fused_moe import align_by_expert, fused_experts_triton
from model_server.kernels.fused_moe_torch import (
    fused_experts_grouped,
    fused_experts_per_token,
    sort_by_expert,
)
from model_server.kernels.portable import pack_int4
from model_server.kernels.table import TORCH_KERNELS, triton_kernels
from model_server.kernels.wna16_linear import wna16_linear
from model_server.layers.fused_moe import FusedMoE, grouped_topk, softmax_topk
from model_server.layers.quantization.wna16_moe import WNA16Experts

pytestmark = pytest.mark.kernels

E, H, INTER, TOP_K = 6, 32, 48, 2


def _experts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
    return w13, w2


def _routing(num_tokens: int, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, E, generator=gen)
    if skew:  # expert 2 wins almost everywhere, experts 4 and 5 never
        logits[:, 2] += 4.0
        logits[:, 4:] -= 10.0
    weights, ids = softmax_topk(logits, TOP_K, renormalize=True)
    x = torch.randn(num_tokens, H, generator=gen)
    return x, weights, ids


def _hf_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """transformers 5's MixtralExperts loop with our weights."""
    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
    config._experts_implementation = "eager"  # the loop over experts, not torch's grouped mm
    experts = MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        return experts(x, ids, weights)


@pytest.mark.parametrize(("num_tokens", "skew"), [(1, False), (7, False), (19, True)])
def test_grouped_equals_per_token_and_hf(num_tokens: int, skew: bool) -> None:
    w13, w2 = _experts(0)
    x, weights, ids = _routing(num_tokens, seed=num_tokens, skew=skew)
    grouped = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
    naive = fused_experts_per_token(x, w13, w2, weights, ids, TORCH_KERNELS)
    torch.testing.assert_close(grouped, naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grouped, _hf_reference(x, w13, w2, weights, ids))
    if skew:
        assert set(ids.flatten().tolist()) <= {0, 1, 2, 3}


def test_sort_by_expert_groups_pairs() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 3]])
    order, token_of, counts = sort_by_expert(ids, 5)
    assert counts == [2, 0, 1, 3, 0]
    assert ids.flatten()[order].tolist() == [0, 0, 2, 3, 3, 3]
    assert token_of.tolist() == [0, 1, 1, 0, 2, 2]  # stable: token order within an expert


def test_align_by_expert_pads_each_run_to_whole_tiles() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 3], [1, 3]])  # P = 8 pairs
    sorted_pairs, block_expert = align_by_expert(ids, 5, block_m=4)
    tiles = sorted_pairs.view(-1, 4).tolist()
    assert len(tiles) == 2 + 5  # cdiv(8, 4) + E
    runs = {
        e: [p for t, tile in zip(block_expert.tolist(), tiles, strict=True) if t == e for p in tile]
        for e in range(5)
    }
    flat = ids.flatten().tolist()
    for e in range(5):
        real = [p for p in runs[e] if p < 8]
        assert real == [i for i, x in enumerate(flat) if x == e]
        assert all(p == 8 for p in runs[e][len(real) :])  # the padding sentinel
    assert block_expert.tolist() == [0, 1, 2, 3, -1, -1, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "skew"), [(1, False), (9, True)])
def test_triton_fused_moe_matches_grouped(
    num_tokens: int, skew: bool, dtype: torch.dtype, device: str
) -> None:
    w13, w2 = (w.to(device, dtype) for w in _experts(1))
    x, weights, ids = _routing(num_tokens, seed=10 + num_tokens, skew=skew)
    x, weights, ids = x.to(device, dtype), weights.to(device), ids.to(device)
    expected = fused_experts_grouped(
        x.float(), w13.float(), w2.float(), weights, ids, TORCH_KERNELS
    )
    got = fused_experts_triton(x, w13, w2, weights, ids, TORCH_KERNELS)
    assert got.dtype == dtype and got.shape == (num_tokens, H)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_fused_moe_layer_loads_per_expert_and_stacked_checkpoints() -> None:
    w13, w2 = _experts(2)
    per_expert = FusedMoE(E, H, INTER)
    for e in range(E):
        per_expert.weight_loader(per_expert.w13_weight, w13[e, :INTER], "gate", e)
        per_expert.weight_loader(per_expert.w13_weight, w13[e, INTER:], "up", e)
        per_expert.weight_loader(per_expert.w2_weight, w2[e], "down", e)
    stacked = FusedMoE(E, H, INTER)
    stacked.weight_loader(stacked.w13_weight, w13)
    stacked.weight_loader(stacked.w2_weight, w2)
    assert torch.equal(per_expert.w13_weight, w13) and torch.equal(stacked.w13_weight, w13)
    assert torch.equal(per_expert.w2_weight, w2) and torch.equal(stacked.w2_weight, w2)
    with pytest.raises(ValueError, match=r"experts 0.gate: checkpoint tensor has shape \(3, 32\)"):
        stacked.weight_loader(stacked.w13_weight, torch.zeros(3, H), "gate", 0)
    x, weights, ids = _routing(5, seed=3)
    expected = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
    torch.testing.assert_close(stacked(x, weights, ids), expected)


def test_deepseek_v3_routing_uses_bias_to_choose_and_scores_to_weigh() -> None:
    logits = torch.tensor([[0.0, 0.1, 2.0, 1.9, -1.0, -1.2, 0.5, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0, 0.0, 0.0])
    # Groups of 2: the bias makes group 2 (experts 4, 5) the best; 2 groups allowed.
    weights, ids = grouped_topk(
        logits, 2, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        routed_scaling_factor=2.0, norm_topk_prob=True, correction_bias=bias,
    )  # fmt: skip
    assert sorted(ids[0].tolist()) == [4, 5]
    s = torch.sigmoid(logits[0, [4, 5]])
    torch.testing.assert_close(weights[0].sort().values, (2.0 * s / s.sum()).sort().values)
    # V2 group-limited greedy: the best 1 of 4 groups by max softmax score, then the top 2.
    weights, ids = grouped_topk(
        logits, 2, scoring="softmax", topk_method="group_limited_greedy", n_group=4,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    )  # fmt: skip
    assert sorted(ids[0].tolist()) == [2, 3]
    probs = F.softmax(logits[0], dim=-1)
    torch.testing.assert_close(weights[0].sort().values, probs[[3, 2]].sort().values)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_triton_table_runs_quantized_experts_through_its_wna16_kernel(
    bits: int, num_tokens: int, device: str
) -> None:
    """GPTQ/AWQ experts kept quantized (layers/quantization/wna16_moe.py) on the triton table:
    grouped per expert, each matmul the Triton wNa16 kernel, equal to the float experts of the
    same dequantized weights."""
    gen = torch.Generator().manual_seed(bits + num_tokens)

    def experts(n: int, k: int, group_size: int = 32) -> WNA16Experts:
        q = torch.randint(0, 1 << bits, (E, n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(E, n, k // group_size, generator=gen) * 0.02 + 0.001
        offsets = -scales * (1 << (bits - 1))
        codes = torch.stack([pack_int4(q[e]) for e in range(E)]) if bits == 4 else q
        return WNA16Experts("gptq", bits, group_size, codes, scales, offsets, None).to(device)

    inter = 64  # 4-bit codes come in blocks of 32 along K
    w13, w2 = experts(2 * inter, H), experts(H, inter)
    x, weights, ids = _routing(num_tokens, seed=num_tokens, skew=num_tokens > 1)
    x, weights, ids = x.to(device), weights.to(device), ids.to(device)
    calls = []

    def counting_wna16(*args):
        calls.append(args[1].shape)
        return wna16_linear(*args)

    kernels = replace(triton_kernels(), wna16_linear=counting_wna16)
    got = fused_experts_triton(x, w13, w2, weights, ids, kernels)
    want = fused_experts_grouped(x, w13.dequantize(), w2.dequantize(), weights, ids, TORCH_KERNELS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    used = len(set(ids.flatten().tolist()))
    assert len(calls) == 2 * used  # gate_up and down of each expert that has tokens
