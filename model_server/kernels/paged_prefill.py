"""Paged prefill attention over variable-length query chunks (chunked prefill, prefix-cache hits).

Every K/V is read from the paged cache, the chunk's own new tokens included: the backend stores
them first, so one code path serves whole prompts, later chunks and prefix-cache hits alike
(as vLLM's unified Triton attention does). The new tokens are causal within the chunk and see the
whole cached prefix before it: query j of request i sits at position
`seq_lens[i] - query_len_i + j` and attends to positions <= that.

Grid: (num_prefills, cdiv(max_query_len, BLOCK_Q), num_kv_heads). A program takes BLOCK_Q query
tokens of one request and all `G = num_heads // num_kv_heads` query heads that share one KV head,
packed as the BLOCK_M = BLOCK_Q * G rows of `tl.dot` (row r is token r // G, head r % G), so each
K/V tile is loaded once per KV head. Programs whose query tile lies past their request's query
length exit at once. The key loop runs in two phases: tiles wholly before the tile's first query
position need no causal mask; the remaining (diagonal) tiles are masked.
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


# first_seq (= num_decodes) changes every step: not specialised, so no recompiles mid-serving.
@triton.jit(do_not_specialize=["first_seq"])
def _paged_prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    first_seq,  # index of the first prefill request (= num_decodes)
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_bt: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # power of two >= BLOCK_Q * NUM_QUERIES_PER_KV, >= 16
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # compute the dots in fp32 (see dot_config)
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # sliding window (0: none)
    SOFT_CAP: tl.constexpr = 0.0,  # attention logit soft cap (0: none)
    k_scale_ptr=None,  # quantized caches: [num_blocks, block_size, Hkv] float32 (attention_tile)
    v_scale_ptr=None,
    CODE_FACTOR: tl.constexpr = 1.0,
    KV_QUANT: tl.constexpr = 0,  # 0: float cache; 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
):
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this chunk

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # token within the chunk
    heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    dims = tl.arange(0, BLOCK_D)
    io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    tok = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] flat token index

    # [BLOCK_M, BLOCK_D]; padded rows are zeros (their scores are finite, results discarded).
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K, V and P follow q's dtype in attend_paged_tile
    q_pos = context_len + q_idx  # [BLOCK_M] absolute positions
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    first_q_pos = context_len + q_tile * BLOCK_Q
    # Keys this tile can see: up to the last query position in it (or the context end).
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)
    # Phase 1: tiles entirely at positions <= first_q_pos are visible to every row (none with
    # a window: its lower edge moves with each row).
    if WINDOW > 0:
        num_full_tiles = 0
        first_tile = tl.maximum(first_q_pos - WINDOW + 1, 0) // TILE_N
    else:
        num_full_tiles = (first_q_pos + 1) // TILE_N
        first_tile = num_full_tiles
    for t in range(num_full_tiles):
        m_i, l_i, acc = attend_paged_tile(
            q,
            m_i,
            l_i,
            acc,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            t * TILE_N,
            0,
            kv_end,
            q_pos,
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
            0,
            SOFT_CAP,
            k_scale_ptr,
            v_scale_ptr,
            CODE_FACTOR,
            KV_QUANT,
        )
    # Phase 2: the diagonal tiles (with a window: every tile it reaches), masked per row.
    for t in range(first_tile, tl.cdiv(kv_end, TILE_N)):
        m_i, l_i, acc = attend_paged_tile(
            q,
            m_i,
            l_i,
            acc,
            key_cache_ptr,
            value_cache_ptr,
            block_table_ptr,
            t * TILE_N,
            0,
            kv_end,
            q_pos,
            qk_scale,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            dims,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            TILE_N,
            True,
            DOT_PRECISION,
            WINDOW,
            SOFT_CAP,
            k_scale_ptr,
            v_scale_ptr,
            CODE_FACTOR,
            KV_QUANT,
        )

    acc = acc / l_i[:, None]
    out = out_ptr + tok[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_block_m(num_queries_per_kv: int) -> int:
    """Rows per program: 64 (measured best on H100 for D 128, bf16), at least the GQA group."""
    return max(64, triton.next_power_of_2(num_queries_per_kv))


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Causal attention for requests `[first_seq, first_seq + num_seqs)`, written into `out`.

    query, out: [T, H, D] over the whole step (any token/head strides); the requests' K/V,
    new tokens included, must already be in key_cache/value_cache [num_blocks, block_size, Hkv, D].
    query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks]: int32, as in
    AttentionMetadata. `max_query_len` is a host int >= every such request's query length.
    With `sliding_window` W a query at position p sees keys in (p - W, p] (the blocks before
    are never read); `logits_soft_cap` c caps scores as c tanh(s / c). Quantized caches (int8 /
    float8 codes) come with `k_scales`, `v_scales` [num_blocks, block_size, Hkv] float32
    (kernels/kv_cache_dtype.py).
    """
    if num_seqs == 0 or max_query_len == 0:
        return
    key_cache, value_cache, quant = kv_quant_args(key_cache, value_cache, k_scales, v_scales)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if query.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("query, out and the caches must be contiguous along head_dim")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share one layout")
    if block_m is None:
        block_m = prefill_block_m(group)
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = max(16, triton.next_power_of_2(head_dim))
    if tile_n is None:
        tile_n = default_tile_n(block_d, query.dtype)
    upcast_dot, dot_precision = dot_config(query.dtype)
    if num_warps is None:
        # 4 warps measured best for 64-row tiles at D 128; larger tiles need more registers.
        num_warps = 4 if block_m * block_d <= 64 * 128 else 8
    if num_stages is None:
        num_stages = 2

    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        first_seq,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        WINDOW=sliding_window or 0,
        SOFT_CAP=float(logits_soft_cap or 0.0),
        num_warps=num_warps,
        num_stages=num_stages,
        **quant,
    )
