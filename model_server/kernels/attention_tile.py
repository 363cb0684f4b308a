"""The inner step shared by the paged decode and prefill kernels: one online-softmax update.

A tile is TILE_N consecutive context positions of one request, for one KV head. Positions are
mapped to cache slots one by one through the block table (`block = table[pos // BLOCK_SIZE]`), so a
tile may span several cache blocks and TILE_N is independent of the block size (block size 8 works
with the TILE_N >= 16 that `tl.dot` needs). Scores live in the log2 domain: `qk_scale` is the
softmax scale times log2(e), and the running max `m_i` / sum `l_i` use exp2.

Optional (constexpr, 0 = off): `WINDOW`, a sliding window (a row at position p sees keys in
(p - WINDOW, p]; causal tiles only, decode callers narrow `kv_start` instead), and `SOFT_CAP`,
Gemma 2's c * tanh(score / c) on the scaled scores. With a window a row may see no key in its
first tiles, so the running max is guarded against -inf.

`KV_QUANT` (kv_cache_dtype.py's codes: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2; 0 a float cache) reads
quantized caches: codes (int8, or fp8 bits through a uint8 view of the cache) with one float32
scale per slot and KV head, `scale_ptr[slot_offset // HEAD_DIM]` (contiguous caches). Codes
become exact values of q's dtype (fp8 through fp16 bits, so no fp8 instructions: sm_80 runs it),
the K scales multiply the scores' columns and the V scales the probabilities' columns, so the
dots run on the codes as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_server.kernels.triton_compat import interpreting

# kv_cache_dtype.py's format codes, as Triton constants.
_INT8 = tl.constexpr(1)
_FP8_E4M3 = tl.constexpr(2)


@triton.jit
def fp8_bits_as_f16(x, KV_QUANT: tl.constexpr):
    """fp8 bits (uint8) -> fp16 holding the value exactly (e5m2), or the value / 256 (e4m3: its
    exponent and mantissa below the fp16's top exponent bit; `code_factor` undoes it)."""
    x16 = x.to(tl.uint16)
    if KV_QUANT == _FP8_E4M3:
        bits = ((x16 & 0x80) << 8) | ((x16 & 0x7F) << 7)
    else:
        bits = x16 << 8
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def kv_codes(x, KV_QUANT: tl.constexpr):
    """A loaded tile of quantized codes as values (times 1 / code_factor), or x for floats."""
    # One return: Triton unifies the types of every return statement it reads.
    if KV_QUANT <= _INT8:
        values = x
    else:
        values = fp8_bits_as_f16(x, KV_QUANT)
    return values


def code_factor(kv_quant: int) -> float:
    """What fp8_bits_as_f16's values are multiplied by to be the codes' (host side)."""
    return 256.0 if kv_quant == 2 else 1.0


@triton.jit
def attend_paged_tile(
    q,  # [BLOCK_M, BLOCK_D] query rows (compute dtype; padded rows are zeros)
    m_i,  # [BLOCK_M] fp32 running max of the log2-scaled scores
    l_i,  # [BLOCK_M] fp32 running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, BLOCK_D] fp32 running sum of p @ V
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_table_ptr,  # this request's row of block ids (int32)
    tile_start,  # first context position of the tile
    kv_start,  # positions < kv_start are masked out (a window's or split's start)
    kv_end,  # positions >= kv_end are masked out (context end or split end)
    q_pos,  # [BLOCK_M] absolute position of each query row (read only when CAUSAL)
    qk_scale,  # softmax scale * log2(e)
    kv_head_offset,  # kv_head * cache head stride (int64)
    stride_cache_block,
    stride_cache_slot,
    dims,  # tl.arange(0, BLOCK_D)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SOFT_CAP: tl.constexpr = 0.0,
    k_scale_ptr=None,  # [num_blocks, block_size, Hkv] float32, quantized caches only
    v_scale_ptr=None,
    CODE_FACTOR: tl.constexpr = 1.0,  # code_factor(KV_QUANT)
    KV_QUANT: tl.constexpr = 0,
):
    pos = tile_start + tl.arange(0, TILE_N)
    in_range = (pos >= kv_start) & (pos < kv_end)
    # Out-of-range positions read block 0 (always a valid block) but are masked anyway: the block
    # table row may be shorter than the tile.
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    slot_offset = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
    slot_offset += kv_head_offset  # [TILE_N]
    if HEAD_DIM == BLOCK_D:
        # No mask along head_dim keeps the mask constant along the contiguous axis (vector loads).
        k_mask = in_range[None, :]
        v_mask = in_range[:, None]
    else:
        d_mask = dims < HEAD_DIM
        k_mask = in_range[None, :] & d_mask[:, None]
        v_mask = in_range[:, None] & d_mask[None, :]

    # K^T tile [BLOCK_D, TILE_N]; masked entries are 0 (never NaN from stale cache memory).
    k = tl.load(key_cache_ptr + slot_offset[None, :] + dims[:, None], mask=k_mask, other=0)
    k = kv_codes(k, KV_QUANT)
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if KV_QUANT > 0:
        # Masked positions get scale 0: their scores are masked below anyway.
        k_scale = tl.load(k_scale_ptr + slot_offset // HEAD_DIM, mask=in_range, other=0.0)
        s = s * (k_scale * CODE_FACTOR)[None, :]
    if SOFT_CAP > 0:
        # s is in log2 units (qk_scale folds log2(e)): cap the natural-log score, convert back.
        # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x.
        cap_log2 = SOFT_CAP * 1.4426950408889634
        s = (1.0 - 2.0 / (tl.exp(2.0 * (s / cap_log2)) + 1.0)) * cap_log2
    if CAUSAL:
        valid = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            valid = valid & (pos[None, :] > q_pos[:, None] - WINDOW)
    else:
        valid = in_range[None, :]
    s = tl.where(valid, s, float("-inf"))

    # Without a window every row has seen at least one valid position by its first tile
    # (position 0 for prefill rows, the split's first position for decode rows), so m_new is
    # finite after it. With one, a row may have seen none yet: m_use keeps exp2 away from
    # -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOW > 0:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(value_cache_ptr + slot_offset[:, None] + dims[None, :], mask=v_mask, other=0)
    v = kv_codes(v, KV_QUANT)
    acc = acc * alpha[:, None]
    if KV_QUANT > 0:
        v_scale = tl.load(v_scale_ptr + slot_offset // HEAD_DIM, mask=in_range, other=0.0)
        pv = p * (v_scale * CODE_FACTOR)[None, :]
    else:
        pv = p
    acc += tl.dot(pv.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Bytes of one K (or V) tile, TILE_N x BLOCK_D, that the default tile width stays within. The
# pipelined K/V tiles then fit the 99 KiB of shared memory a block may use on sm_86/sm_89 (A10, L4,
# RTX 30/40): at TILE_N 64, fp32 with D 128 needs 112 KiB in the prefill kernel (see
# `python -m tools.compile_check`); bf16/fp16 up to D 128 keep TILE_N 64.
_MAX_KV_TILE_BYTES = 16 * 1024


def default_tile_n(block_d: int, dtype: torch.dtype) -> int:
    """Context positions per tile: 64, halved (down to the 16 `tl.dot` needs) while one K tile of
    `block_d` columns in `dtype` would exceed 16 KiB."""
    tile_n = 64
    elt = torch.empty((), dtype=dtype).element_size()
    while tile_n > 16 and tile_n * block_d * elt > _MAX_KV_TILE_BYTES:
        tile_n //= 2
    return tile_n


def kv_quant_args(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The caches as the kernels read them (fp8 as uint8 views) and the tile's quantization
    arguments (k_scale_ptr, v_scale_ptr, CODE_FACTOR, KV_QUANT) for a launch's kwargs."""
    codes = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
    kv_quant = codes.get(key_cache.dtype, 0)
    if kv_quant == 0:
        return key_cache, value_cache, {}
    if k_scales is None or v_scales is None:
        raise ValueError(f"a {key_cache.dtype} KV cache needs its scales")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("quantized KV caches must be contiguous (scales are found by slot)")
    if kv_quant > 1:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    extra = dict(
        k_scale_ptr=k_scales,
        v_scale_ptr=v_scales,
        CODE_FACTOR=code_factor(kv_quant),
        KV_QUANT=kv_quant,
    )
    return key_cache, value_cache, extra


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for a query dtype.

    fp32 inputs use exact fp32 dots (matching the torch reference), not TF32. The Triton 3.7
    interpreter multiplies bf16 dot operands as their raw uint16 bits, so under it bf16 tiles are
    upcast to fp32 first (UPCAST_DOT); compiled GPU kernels keep bf16 tensor-core dots.
    """
    upcast = dtype == torch.bfloat16 and interpreting()
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"
