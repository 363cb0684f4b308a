"""Neox rotary embedding of a step's queries and keys in one launch (the `rotary_embedding` slot
on CUDA), where PyTorch's ops take fifteen (a gather of cos/sin, four products, a sum and a
difference and a concatenation for each of q and k): at batch 1 on an H200 those launches cost
an 8B model about 0.8 ms of its 5.8 ms decode step (tools/gpu_profile.py).

Grid: (tokens,). A program reads its token's position, that row of the cos/sin cache and every
query and key head of the token, and writes the rotated rows into new contiguous tensors.

Numerics are `rotary_embedding_torch`'s (kernels/portable.py) bit for bit on a GPU: each product
is formed in float32 and rounded to the inputs' dtype, then the sum or difference likewise
(exact for fp32; the product of two bf16/fp16 values is exact in fp32, so this is PyTorch's
rounding). The launch disables FMA contraction, which would skip the product's rounding. Under
TRITON_INTERPRET=1 the fp32 -> bf16 casts truncate instead of rounding (see test_fused_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_tok: tl.int64,
    stride_head: tl.int64,
    cos,  # [1, BLOCK_HALF] float32, already rounded to the dtype
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + token * stride_tok + heads * stride_head + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # PyTorch's order: x1 * cos - x2 * sin and x2 * cos + x1 * sin, every result rounded.
    lo = (a1 * cos).to(dtype).to(tl.float32) - (a2 * sin).to(dtype).to(tl.float32)
    hi = (a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)
    dst = dst_ptr + token * (NUM_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(dst, lo.to(dtype), mask=mask)
    tl.store(dst + HALF, hi.to(dtype), mask=mask)


@triton.jit
def _rotary_neox_kernel(
    positions_ptr,  # [T] int
    q_ptr,  # [T, H, D]: unit stride along D
    k_ptr,  # [T, Hkv, D]
    cos_sin_ptr,  # [max_position, D] contiguous: cos | sin
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_HEADS
    BLOCK_HKV: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + position * (2 * HALF)
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_q_tok, stride_q_head, cos, sin,
        NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_k_tok, stride_k_head, cos, sin,
        NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rotary_embedding` slot (kernels/table.py): positions [T], query [T, H, D], key
    [T, Hkv, D] (unit stride along D; any token and head strides, e.g. views of the fused qkv
    output), cos_sin_cache [max_position, D] -> new contiguous rotated (query, key). Positions
    must be < max_position; the inputs are not written."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if head_dim % 2 or key.shape[2] != head_dim or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"rotary needs an even head_dim shared by q {tuple(query.shape)}, k "
            f"{tuple(key.shape)} and the cache {tuple(cos_sin_cache.shape)}"
        )
    if query.dtype != cos_sin_cache.dtype or key.dtype != query.dtype:
        raise ValueError(
            f"q, k and the cos/sin cache must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{cos_sin_cache.dtype}"
        )
    if query.stride(2) != 1:
        query = query.contiguous()
    if key.stride(2) != 1:
        key = key.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_h = triton.next_power_of_2(num_heads)
    _rotary_neox_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        q_out,
        k_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if block_h * half >= 1024 else 1,
        enable_fp_fusion=False,
    )
    return q_out, k_out
