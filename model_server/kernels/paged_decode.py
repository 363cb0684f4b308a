"""Paged decode attention (one query token per request) with grouped-query heads and split-K.

Grid: (num_seqs, num_kv_heads, num_splits). A program takes one request, one KV head and one
contiguous range of that request's context (its `split_size`, below), and processes the whole
group of `num_heads // num_kv_heads` query heads at once: the group is the M dimension of `tl.dot`
(padded to BLOCK_H >= 16 rows), so every K/V tile is read from memory once per KV head.

With num_splits == 1 the program normalises and writes the output directly. Otherwise
(flash-decoding) each split writes its normalised partial output and log-sum-exp into fp32
scratch buffers, and a second kernel, grid (num_seqs, num_heads), combines the splits.

Each request's context is cut into `num_splits` tile-aligned ranges of its OWN length
(`split_size = roundup(cdiv(seq_len, num_splits), TILE_N)`, computed in the kernel from
`seq_lens`), so the grid and every host argument depend only on the batch size and an upper
bound of the context length: a CUDA graph captured once per batch size replays correctly for
any lengths. Splits past a request's end exit at once; the reduce kernel skips them. A request
of length 0 (a padding row of a graph batch) reads nothing and gets zeros. The number of splits
is chosen on the host from host integers only (see `choose_num_splits`), so the launch never
syncs the device.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import (
    attend_paged_tile,
    default_tile_n,
    dot_config,
    kv_quant_args,
)

LOG2E = math.log2(math.e)


@triton.jit
def _split_size(seq_len, num_splits, TILE_N: tl.constexpr):
    """Context positions per split of a request of `seq_len` tokens (>= TILE_N, tile-aligned)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N), 1) * TILE_N


@triton.jit
def _window_start(seq_len, WINDOW: tl.constexpr):
    """First position a decode query at seq_len - 1 sees: seq_len - WINDOW (0 without one)."""
    if WINDOW > 0:
        return tl.maximum(seq_len - WINDOW, 0)
    return seq_len * 0


# Ints that change from step to step are not specialised (a recompile mid-serving costs seconds).
@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, H, D] (used when not SPLIT)
    partial_out_ptr,  # [num_seqs, H, num_splits, D] fp32 (used when SPLIT)
    partial_lse_ptr,  # [num_seqs, H, num_splits] fp32, log2 domain (used when SPLIT)
    q_ptr,  # [num_seqs, H, D]: request i's single query token
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # splits per request (the partial buffers' split stride)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_bt: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # compute the dots in fp32 (see dot_config)
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # sliding window (0: none): only the last WINDOW positions
    SOFT_CAP: tl.constexpr = 0.0,  # attention logit soft cap (0: none)
    k_scale_ptr=None,  # quantized caches: [num_blocks, block_size, Hkv] float32 (attention_tile)
    v_scale_ptr=None,
    CODE_FACTOR: tl.constexpr = 1.0,
    KV_QUANT: tl.constexpr = 0,  # 0: float cache; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # The splits cover [window_start, seq_len): with a window, the blocks before it are never
    # read (they may be the null block).
    window_start = _window_start(seq_len, WINDOW)
    split_size = _split_size(seq_len - window_start, num_splits, TILE_N)
    split_start = window_start + split * split_size
    # Split 0 always runs, so an empty (padding) request still writes its row (zeros).
    if split > 0 and split_start >= seq_len:
        return
    split_end = tl.minimum(split_start + split_size, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * NUM_QUERIES_PER_KV + rows
    row_mask = rows < NUM_QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]

    # [BLOCK_H, BLOCK_D]: the query heads sharing this KV head; padded rows are zeros.
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K, V and P follow q's dtype in attend_paged_tile
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    block_table_ptr = block_tables_ptr + seq * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    num_tiles = tl.cdiv(split_end - split_start, TILE_N)
    for t in range(num_tiles):
        m_i, l_i, acc = attend_paged_tile(
            q,
            m_i,
            l_i,
            acc,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            split_start + t * TILE_N,
            split_start,
            split_end,
            m_i,  # q_pos: unused (decode rows see the whole context up to split_end)
            qk_scale,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            dims,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            TILE_N,
            False,
            DOT_PRECISION,
            0,  # the window is the split range itself
            SOFT_CAP,
            k_scale_ptr,
            v_scale_ptr,
            CODE_FACTOR,
            KV_QUANT,
        )

    # l_i >= 1 whenever a position was read (the max contributes exp2(0)); 0 only when empty.
    acc = acc / tl.maximum(l_i, 1e-30)[:, None]
    if SPLIT:
        # Partial rows are (seq, head, split); the lse lets the reduce kernel reweight them.
        row = (seq * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)
        tl.store(partial_lse_ptr + row, m_i + tl.log2(l_i), mask=row_mask)
    else:
        out = out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [num_seqs, H, D]
    partial_out_ptr,  # [num_seqs, H, num_splits, D] fp32
    partial_lse_ptr,  # [num_seqs, H, num_splits] fp32, log2 domain
    seq_lens_ptr,  # [num_seqs] int32
    num_splits,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    TILE_N: tl.constexpr,  # the decode kernel's, so both derive the same split_size
    WINDOW: tl.constexpr = 0,  # the decode kernel's
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    span = seq_len - _window_start(seq_len, WINDOW)
    # Splits past this request's context were never written (none for an empty request).
    num_valid = tl.cdiv(span, _split_size(span, num_splits, TILE_N))

    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < num_valid
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    row = (seq * NUM_HEADS + head) * num_splits + splits  # [BLOCK_S]

    lse = tl.load(partial_lse_ptr + row, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    weight = tl.where(s_mask, weight, 0.0)
    partial = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # An empty request has no valid split: all weights 0, and it gets zeros, not 0/0.
    result = tl.sum(partial * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    out = out_ptr + seq * stride_o_tok + head * stride_o_head + dims
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    *,
    min_split_tokens: int = 256,
    max_splits: int = 16,
    target_programs: int = 512,
) -> int:
    """How many context splits to use, from host integers only.

    Split only while the (seq, kv head) programs alone would leave the GPU under-filled
    (`target_programs`, about 4 per SM), and never below `min_split_tokens` per split.
    """
    base = max(num_seqs * num_kv_heads, 1)
    want = target_programs // base
    return max(1, min(max_splits, want, -(-max_seq_len // min_split_tokens)))


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int = 1,
    *,
    tile_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Decode attention for requests with exactly one query token each, written into `out`.

    query, out: [num_seqs, H, D] (row i is request i's token; any token/head strides);
    key_cache, value_cache: [num_blocks, block_size, Hkv, D]; seq_lens: [num_seqs] int32 context
    lengths (including the token being decoded, whose K/V must already be stored; 0 marks a
    padding row, whose output is zeros); block_tables: [num_seqs, >= cdiv(max_seq_len,
    block_size)] int32. `max_seq_len` is a host int >= every seq_len (an upper bound such as
    max_model_len is fine: nothing else depends on the real lengths); `num_splits` is an upper
    bound on context splits per request (1: no reduce pass). With `sliding_window` W only the
    last W positions of each context are read; `logits_soft_cap` c caps scores as c tanh(s / c).
    Quantized caches (int8 / float8 codes) come with `k_scales`, `v_scales` [num_blocks,
    block_size, Hkv] float32 (kernels/kv_cache_dtype.py).
    """
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return
    key_cache, value_cache, quant = kv_quant_args(key_cache, value_cache, k_scales, v_scales)
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if query.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("query, out and the caches must be contiguous along head_dim")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share one layout")
    block_d = max(16, triton.next_power_of_2(head_dim))
    if tile_n is None:
        tile_n = default_tile_n(block_d, query.dtype)
    upcast_dot, dot_precision = dot_config(query.dtype)
    block_h = max(16, triton.next_power_of_2(group))

    # Splits are tile-aligned: more splits than the longest request has tiles would be empty.
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    num_splits = max(1, min(num_splits, -(-max(span, 1) // tile_n)))
    split = num_splits > 1

    if split:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        partial_out = partial_lse = out  # unused placeholders

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out,
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale * LOG2E,
        num_splits,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SPLIT=split,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        WINDOW=sliding_window or 0,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **quant,
    )
    if split:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            seq_lens,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            TILE_N=tile_n,
            WINDOW=sliding_window or 0,
            num_warps=4 if head_dim >= 128 else 2,
        )
