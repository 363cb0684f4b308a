"""Routers of the mixture-of-experts models: router logits -> (top-k weights, top-k expert ids).

Each follows its HF reference's arithmetic (transformers 5): scores in float32, the same top-k,
the same normalisation, so a tie between experts breaks the same way.
  - `softmax_topk` (kernels/fused_moe_torch.py, the kernel table's `moe_softmax_topk`): Mixtral
    (always renormalised), Qwen2-MoE / Qwen3-MoE (`norm_topk_prob`).
  - `grouped_topk`: DeepSeek. V2: softmax scores, `greedy` or `group_limited_greedy` (the best
    `topk_group` of `n_group` expert groups by their best score); V3 (`noaux_tc`): sigmoid
    scores, the choice made on scores + `e_score_correction_bias`, groups ranked by the sum of
    their two best, weights the uncorrected scores (renormalised with `norm_topk_prob`). Both
    scale the weights by `routed_scaling_factor`.
Outputs: weights [T, k] float32, ids [T, k] int64.
"""

from __future__ import annotations

import torch

# The portable one; a model's blocks call their kernel table's `moe_softmax_topk`, which runs
# the same arithmetic (natively on the CPU: kernels/cpu/moe.c).
from model_server.kernels.fused_moe_torch import softmax_topk

__all__ = ["grouped_topk", "softmax_topk"]


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
    """DeepSeek routing. router_logits [T, E] float32 -> (weights [T, k] float32, ids [T, k]).

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
