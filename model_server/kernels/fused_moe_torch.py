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
