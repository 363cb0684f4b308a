"""Writes a step's new keys and values into the paged KV cache (vLLM's reshape_and_cache_flash).

One program per token copies its [num_kv_heads, head_dim] key and value rows into cache slot
`slot_mapping[t]` (a flat index over `num_blocks * block_size`). A negative slot marks a padding
token (e.g. a CUDA-graph batch padded past the real tokens): its program writes nothing.

Quantized caches (`KV_QUANT`: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2) get each head row's codes and its
float32 scale (scales [num_blocks, block_size, Hkv], contiguous), bit for bit as
kv_cache_dtype.quantize_kv: int8 rounds half to even through the 1.5 * 2^23 trick, fp8 codes
are rounded to nearest even in integer arithmetic (no fp8 instructions: sm_80 runs it) and
stored through a uint8 view of the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import kv_quant_args

_INT8 = tl.constexpr(1)


@triton.jit
def _round_half_even(y):
    """Round fp32 |y| < 2^22 to the nearest integer, ties to even (the FPU's own rounding)."""
    magic = 12582912.0  # 1.5 * 2^23: adding it leaves no fraction bits
    return (y + magic) - magic


@triton.jit
def _fp8_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """fp32 y, |y| <= the format's largest finite value -> the nearest fp8 bits (MBITS mantissa
    bits, exponent bias BIAS) as int32, ties to even, subnormals included: PyTorch's cast."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = (a >> 23) - 127 + BIAS  # the fp8 biased exponent
    normal = e >= 1
    mant = tl.where(normal, a & 0x7FFFFF, (a & 0x7FFFFF) | 0x800000)
    sh = tl.where(normal, 23 - MBITS, 23 - MBITS + 1 - e)
    zero = (e < 1) & ((a < 0x800000) | (sh > 24))
    sh = tl.minimum(sh, 24)
    base = tl.where(normal, e << MBITS, 0)
    q = mant >> sh
    one = tl.full(sh.shape, 1, tl.int32)
    rem = mant & ((one << sh) - 1)
    half = one << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return tl.where(zero, sign, sign | (base + q + up.to(tl.int32)))


@triton.jit
def _quantize_rows(
    x,
    fixed_scale,
    QMAX: tl.constexpr,
    KV_QUANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
):
    """x [BLOCK_H, BLOCK_D] fp32 (padding zeros) -> (codes in the cache's storage, scales): each
    row's own max|x| / QMAX, or `fixed_scale` > 0 for every row (a static per-layer scale).
    Divisions round to nearest (div_rn), as PyTorch's: a GPU's default fp32 division does not."""
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
    own = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    scale = tl.where(fixed_scale > 0, tl.full(amax.shape, 1.0, tl.float32) * fixed_scale, own)
    div = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, tl.broadcast_to(div[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KV_QUANT == _INT8:
        codes = _round_half_even(y).to(tl.int8)
    else:
        codes = _fp8_bits(y, MBITS, BIAS).to(tl.uint8)
    return codes, scale


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
    k_scale_ptr=None,  # quantized caches: [num_blocks, block_size, Hkv] float32
    v_scale_ptr=None,
    fixed_scale=0.0,  # quantized caches: every row's static scale; 0: each row's own
    QMAX: tl.constexpr = 0.0,
    KV_QUANT: tl.constexpr = 0,  # 0: float cache; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
    FP8_MBITS: tl.constexpr = 3,  # fp8 mantissa bits and exponent bias (e4m3: 3, 7; e5m2: 2, 15)
    FP8_BIAS: tl.constexpr = 7,
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

    # Padding lanes read 0: a quantized row's max must not see them.
    k = tl.load(
        key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
        mask=mask,
        other=0.0,
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
    if KV_QUANT > 0:
        k_codes, k_scale = _quantize_rows(
            k.to(tl.float32), fixed_scale, QMAX, KV_QUANT, FP8_MBITS, FP8_BIAS
        )
        v_codes, v_scale = _quantize_rows(
            v.to(tl.float32), fixed_scale, QMAX, KV_QUANT, FP8_MBITS, FP8_BIAS
        )
        tl.store(kc, k_codes, mask=mask)
        tl.store(vc, v_codes, mask=mask)
        head_mask = heads < NUM_KV_HEADS
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + heads, k_scale, mask=head_mask)
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + heads, v_scale, mask=head_mask)
    else:
        tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    fixed_scale: float | None = None,
) -> None:
    """key, value: [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at `slot_mapping` [T].

    Slots < 0 are skipped. Values are cast to the cache dtype, or quantized with their scales
    into `k_scales`, `v_scales` [num_blocks, block_size, Hkv] float32 for int8 / float8 caches
    (each row's own, or `fixed_scale` for every row). In place; never syncs the device.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous along head_dim")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("KV caches must be contiguous along head_dim")
    block_size = key_cache.shape[1]
    qmax = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
    quant: dict = {}
    if key_cache.dtype in qmax:
        if k_scales is None or v_scales is None or k_scales.dtype != torch.float32:
            raise ValueError(f"a {key_cache.dtype} KV cache needs float32 scales")
        if not (k_scales.is_contiguous() and v_scales.is_contiguous()):
            raise ValueError("KV scales must be contiguous")
        e5m2 = key_cache.dtype == torch.float8_e5m2
        quant_qmax = qmax[key_cache.dtype]
        key_cache, value_cache, tile = kv_quant_args(key_cache, value_cache, k_scales, v_scales)
        quant = dict(
            k_scale_ptr=k_scales,
            v_scale_ptr=v_scales,
            fixed_scale=float(fixed_scale or 0.0),
            QMAX=quant_qmax,
            KV_QUANT=tile["KV_QUANT"],
            FP8_MBITS=2 if e5m2 else 3,
            FP8_BIAS=15 if e5m2 else 7,
        )
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
        **quant,
    )
