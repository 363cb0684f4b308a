"""Writes a step's new keys and values into the paged KV cache (vLLM's reshape_and_cache_flash).

One program per token copies its [num_kv_heads, head_dim] key and value rows into cache slot
`slot_mapping[t]` (a flat index over `num_blocks * block_size`). A negative slot marks a padding
token (e.g. a CUDA-graph batch padded past the real tokens): its program writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D], any token/head strides, unit stride on D
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_kc_block: tl.int64,
    stride_kc_slot: tl.int64,
    stride_kc_head: tl.int64,
    stride_vc_block: tl.int64,
    stride_vc_slot: tl.int64,
    stride_vc_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(
        key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
        mask=mask,
    )
    kc = (
        key_cache_ptr
        + block * stride_kc_block
        + offset_in_block * stride_kc_slot
        + heads[:, None] * stride_kc_head
        + dims[None, :]
    )
    vc = (
        value_cache_ptr
        + block * stride_vc_block
        + offset_in_block * stride_vc_slot
        + heads[:, None] * stride_vc_head
        + dims[None, :]
    )
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slots < 0 are skipped. Values are cast to the cache dtype. In place; never syncs the device.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous along head_dim")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("KV caches must be contiguous along head_dim")
    block_size = key_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
