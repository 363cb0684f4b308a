"""Fused mixture-of-experts on CUDA with Triton: each expert's matmuls over all of its tokens in
one grouped GEMM launch per projection, the routing done on the device (no host sync).

Steps (`fused_experts_triton`, the CUDA kernel table's `fused_experts`):
  1. `align_by_expert`: the T*k (token, slot) pairs are sorted by expert and each expert's run is
     padded to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list belongs to one
     expert (`block_expert`, -1 for tiles past the end); padding rows hold the sentinel T*k.
  2. `_grouped_gemm_kernel` for gate_up: grid (tiles, cdiv(2I, BLOCK_N)); a program gathers its
     tile's token rows of x, multiplies them by its expert's w13 [2I, H] tile by tile over H
     (fp32 accumulation) and writes rows of the [T*k, 2I] result by pair id.
  3. SiLU-and-mul on [T*k, 2I] (the table's).
  4. The same kernel for down ([T*k, I] rows by pair id, w2 [H, I]), each row scaled by its
     routing weight.
  5. out[t] = sum over the k slots (float32), cast to x's dtype.
fp32 uses exact fp32 dots (`attention_tile.dot_config`), as the reference does. Tile sizes are
untuned: no GPU has measured them yet. Tested on CPUs under TRITON_INTERPRET=1 against
kernels/fused_moe_torch.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import dot_config
from model_server.kernels.fused_moe_torch import fused_experts_grouped

if TYPE_CHECKING:
    from model_server.kernels.table import KernelTable


@triton.jit
def _grouped_gemm_kernel(
    out_ptr,  # [P, N] rows by pair id (P = T * k)
    a_ptr,  # [rows, K]: row = pair // A_ROW_DIV (x by token, or h by pair)
    w_ptr,  # [E, N, K] contiguous
    sorted_pair_ptr,  # [num_tiles * BLOCK_M] int64 pair ids, sentinel P for padding
    block_expert_ptr,  # [num_tiles] int64, -1 past the last expert's run
    topk_weight_ptr,  # [P] float32 (read when MUL_WEIGHT)
    P,
    N,
    K,
    stride_am,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(block_expert_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < P
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_cols = w_ptr + expert.to(tl.int64) * N * K + cols.to(tl.int64)[None, :] * K
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(
            a_rows + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_cols + (k0 + ks)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(topk_weight_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [num_tiles * block_m] int64, block_expert [num_tiles]).

    Device ops only. num_tiles is the bound P / block_m + E (rounded up), so shapes depend on T,
    k and E alone; tiles past the real runs get expert -1 and are skipped by the kernel."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount syncs with the host on CUDA (graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - first_of_expert[expert_of]
    num_tiles = triton.cdiv(num_pairs, block_m) + num_experts
    sorted_pairs = torch.full(
        (num_tiles * block_m,), num_pairs, dtype=torch.int64, device=flat.device
    )
    sorted_pairs[run_start[expert_of] + rank] = order
    tile_start = torch.arange(num_tiles, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    topk_weights: torch.Tensor | None,
    block_m: int,
) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    upcast, precision = dot_config(a.dtype)
    weights = topk_weights if topk_weights is not None else out  # unread without MUL_WEIGHT
    _grouped_gemm_kernel[(block_expert.shape[0], triton.cdiv(n, block_n))](
        out,
        a,
        w,
        sorted_pairs,
        block_expert,
        weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST_DOT=upcast,
        DOT_PRECISION=precision,
    )
    return out


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    kernels: KernelTable,
    *,
    block_m: int = 16,
) -> torch.Tensor:
    """The `KernelTable.fused_experts` contract (kernels/fused_moe_torch.py) in two grouped
    Triton GEMMs; the activation is the table's `silu_and_mul`. Experts kept quantized (GPTQ,
    AWQ: not a float tensor) run grouped per expert through the table's Triton `wna16_linear`
    (`fused_experts_grouped`: it reads each expert's token count on the host, so such models
    run decode steps eagerly, see `MoECausalLM.supports_graphs`)."""
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return fused_experts_grouped(x, w13, w2, topk_weights, topk_ids, kernels)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    sorted_pairs, block_expert = align_by_expert(topk_ids, w13.shape[0], block_m)
    gate_up = _grouped_gemm(x, w13, sorted_pairs, block_expert, num_pairs, top_k, None, block_m)
    h = kernels.silu_and_mul(gate_up)  # [P, I]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = _grouped_gemm(h, w2, sorted_pairs, block_expert, num_pairs, 1, weights, block_m)
    return down.view(num_tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)
