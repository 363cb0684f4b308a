"""Routers of the mixture-of-experts models: router logits -> (top-k weights, top-k expert ids).

Each follows its HF reference's arithmetic (transformers 5): scores in float32, the same top-k,
the same normalisation, so a tie between experts breaks the same way.
  - `softmax_topk` (kernels/fused_moe_torch.py, the kernel table's `moe_softmax_topk`): Mixtral
    (always renormalised), Qwen2-MoE / Qwen3-MoE (`norm_topk_prob`).
  - `grouped_topk` (kernels/fused_moe_torch.py; the kernel table's `moe_grouped_topk` from the
    router's weight, `grouped_topk_of`): DeepSeek. V2: softmax scores, `greedy` or
    `group_limited_greedy` (the best `topk_group` of `n_group` expert groups by their best
    score); V3 (`noaux_tc`): sigmoid
    scores, the choice made on scores + `e_score_correction_bias`, groups ranked by the sum of
    their two best, weights the uncorrected scores (renormalised with `norm_topk_prob`). Both
    scale the weights by `routed_scaling_factor`.
Outputs: weights [T, k] float32, ids [T, k] int64.
"""

from __future__ import annotations

# The portable ones; a model's blocks call their kernel table's `moe_softmax_topk` and
# `moe_grouped_topk`, which run the same arithmetic (natively on the CPU: kernels/cpu/moe.c,
# moe_routing.c).
from model_server.kernels.fused_moe_torch import grouped_topk, softmax_topk

__all__ = ["grouped_topk", "softmax_topk"]
