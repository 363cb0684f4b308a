"""Mixture-of-experts expert computation in PyTorch: the grouped (fused) path and its naive
per-token reference.

Shapes (one rank's experts; under tensor parallelism each holds a slice of every expert's
intermediate dim and the caller all-reduces):
  x [T, H]; w13 [E, 2I, H] (gate rows then up rows of each expert); w2 [E, H, I];
  topk_weights [T, k] float32; topk_ids [T, k] int64 -> out [T, H] in x's dtype:
  out[t] = sum_j topk_weights[t, j] * w2[e] @ silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]),
  e = topk_ids[t, j].

`fused_experts_grouped` sorts the T*k (token, expert) pairs by expert once, so each expert's
two matmuls run once per step over all of its tokens (a [n_e, H] block, not n_e single rows),
then puts the weighted rows back in (token, slot) order and sums each token's k rows in float32
(transformers' loop adds them in expert order in the activation dtype: equal to fp32 rounding).

w13 / w2 may also be a GPTQ / AWQ checkpoint's experts kept quantized (layers/quantization/
wna16_moe.py `WNA16Experts`, with the same (E, N, K) `shape`): each expert's matmul is then
their `expert_linear`, the table's `wna16_linear` on that expert's codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from model_server.kernels.table import KernelTable


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen2/3-MoE's router (HF's arithmetic): router_logits [T, E] -> softmax in
    float32, its top k best first (weights [T, k] float32, ids [T, k] int64), renormalised to
    sum 1 when `renormalize` (Mixtral always; Qwen's `norm_topk_prob`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(slots=True, frozen=True)
class GroupedTopk:
    """DeepSeek's router (models/deepseek.py's `DeepseekRouter`): its weight and how it routes,
    `grouped_topk`'s arguments. The CPU routes natively on it (kernels/cpu/moe_routing.py)."""

    weight: torch.Tensor  # [E, hidden] float32: HF scores x.float() @ weight.float()^T
    correction_bias: torch.Tensor | None  # [E] float32 (V3's e_score_correction_bias)
    top_k: int
    scoring: str  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" (softmax) | "noaux_tc" (sigmoid)
    n_group: int | None
    topk_group: int | None
    routed_scaling_factor: float
    norm_topk_prob: bool


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool: the experts of each token's `topk_group` best groups."""
    num_groups = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, group_idx, 1)
    per_group = num_experts // num_groups
    return mask.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(-1, num_experts).bool()


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing (HF's arithmetic). router_logits [T, E] float32 -> (weights [T, k]
    float32, ids [T, k] in torch.topk's unsorted order).

    scoring "softmax" (V2: topk_method greedy | group_limited_greedy; `norm_topk_prob` is not
    applied, as in HF's V2) or "sigmoid" (V3, noaux_tc: `correction_bias` [E] picks the experts,
    `norm_topk_prob` renormalises).
    """
    num_experts = router_logits.shape[-1]
    if scoring == "softmax":
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        if topk_method == "group_limited_greedy":
            assert n_group is not None and topk_group is not None
            group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(group_scores, topk_group, num_experts), 0.0)
        elif topk_method != "greedy":
            raise ValueError(f"unsupported DeepSeek topk_method {topk_method!r}")
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
        return weights * routed_scaling_factor, ids
    if scoring != "sigmoid":
        raise ValueError(f"unsupported DeepSeek scoring function {scoring!r}")
    scores = router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group and topk_group and n_group > 1:
        group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(-1)
        choice = choice.masked_fill(
            ~_group_mask(group_scores, topk_group, num_experts), float("-inf")
        )
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def grouped_topk_of(x: torch.Tensor, router: GroupedTopk) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> `grouped_topk` of the router's fp32 logits (F.linear(x.float(),
    weight.float()), as HF scores): the kernel table's portable `moe_grouped_topk`."""
    return route_grouped(torch.nn.functional.linear(x.float(), router.weight.float()), router)


def route_grouped(logits: torch.Tensor, router: GroupedTopk) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk` of router logits [T, E] fp32 with the router's settings."""
    return grouped_topk(
        logits,
        router.top_k,
        scoring=router.scoring,
        topk_method=router.topk_method,
        n_group=router.n_group,
        topk_group=router.topk_group,
        routed_scaling_factor=router.routed_scaling_factor,
        norm_topk_prob=router.norm_topk_prob,
        correction_bias=router.correction_bias,
    )


def shared_expert_add(
    routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor
) -> torch.Tensor:
    """Qwen2-MoE's block output: routed [T, H] + sigmoid(gate [T, 1]) * shared [T, H]."""
    return routed + torch.sigmoid(gate) * shared


def expert_linear(x: torch.Tensor, w: Any, expert: int, kernels: KernelTable) -> torch.Tensor:
    """x [M, K] @ W_expert^T -> [M, N]: a stacked float weight [E, N, K] through the table's
    `linear`, or stacked quantized experts through their own `expert_linear`."""
    if isinstance(w, torch.Tensor):
        return kernels.linear(x, w[expert], None)
    return w.expert_linear(expert, x, kernels)


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """topk_ids [T, k] -> (order [T*k]: flat (token, slot) indices grouped by expert ascending,
    stable within an expert; token_of [T*k]: the token of each sorted pair; counts per expert)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // topk_ids.shape[1], counts


def fused_experts_grouped(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    kernels: KernelTable,
) -> torch.Tensor:
    """Each expert's gate_up and down matmul once per call over its tokens (see module doc).
    The matmuls and the activation are the kernel table's (`linear`, `silu_and_mul`)."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    order, token_of, counts = sort_by_expert(topk_ids, w13.shape[0])
    xs = x.index_select(0, token_of)  # [T*k, H], grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = xs[start : start + n]
        h = kernels.silu_and_mul(expert_linear(rows, w13, expert, kernels))  # [n, I]
        ys[start : start + n] = expert_linear(h, w2, expert, kernels)  # [n, H]
        start += n
    weights = topk_weights.reshape(-1).index_select(0, order)  # [T*k] float32
    # Back to (token, slot) order and summed over the k slots in float32. Not index_add_: on
    # CPU it scatters element by element (113 ms for 8 rows of 2048 on a 2-core Zen 4).
    weighted = torch.empty((ys.shape[0], hidden), dtype=torch.float32, device=x.device)
    weighted.index_copy_(0, order, ys.float() * weights[:, None])
    return weighted.view(num_tokens, -1, hidden).sum(dim=1).to(x.dtype)


def fused_experts_per_token(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    kernels: KernelTable,
) -> torch.Tensor:
    """The naive reference: a Python loop over tokens and their k experts, one matrix-vector
    product pair each (T * k small matmuls). Tests and `tools.moe_bench` compare against it."""
    out = torch.zeros_like(x)
    ids = topk_ids.tolist()
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        acc = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
        for j, expert in enumerate(ids[t]):
            h = kernels.silu_and_mul(expert_linear(row, w13, expert, kernels))
            acc += expert_linear(h, w2, expert, kernels).float() * topk_weights[t, j]
        out[t] = acc[0].to(x.dtype)
    return out
