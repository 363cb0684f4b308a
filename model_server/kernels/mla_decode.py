"""Paged decode attention over a latent cache (DeepSeek's multi-head latent attention, absorbed).

The cache holds one row per token, [num_blocks, block_size, L + R]: the KV latent c (L values)
and the shared rope key k_pe (R values). A decode's query arrives absorbed (layers/attention/
mla.py): per head h, [q_lat_h, q_pe_h] of L + R values with q_lat_h = q_nope_h W_uk_h, so that
score_h(t) = q_lat_h . c_t + q_pe_h . k_pe_t and the output is the probability-weighted latent
sum_t p_h(t) c_t (L values), which the caller maps through W_uv_h.

Grid: (num_seqs, cdiv(num_heads, BLOCK_H)). Every head reads the same cache rows (one "KV head"),
so a program takes BLOCK_H >= 16 query heads as the M dimension of `tl.dot` and streams its
request's context once, TILE_N positions at a time through the block table, with an online
softmax (log2 domain). Only device tensors are read for lengths (seq_lens, block_tables), so a
captured CUDA graph replays for any context lengths; a request of length 0 (a padding row of a
graph batch) writes zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import default_tile_n, dot_config

LOG2E = math.log2(math.e)
# Query heads per program: the 16 rows `tl.dot` needs at least.
BLOCK_H = 16


@triton.jit
def _mla_decode_kernel(
    out_ptr,  # [num_seqs, H, L] fp32: the normalised latent output
    q_ptr,  # [num_seqs, H, L + R]: absorbed query (latent part, then rope part)
    cache_ptr,  # [num_blocks, block_size, L + R]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_bt: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    NUM_HEADS: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr,  # next power of two >= LORA
    BLOCK_R: tl.constexpr,  # next power of two >= ROPE
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    l_mask = lat < LORA
    r_mask = rope < ROPE

    q_row = q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head
    q_lat = tl.load(q_row + lat[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(q_row + LORA + rope[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + seq)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for t in range(tl.cdiv(seq_len, TILE_N)):
        pos = t * TILE_N + tl.arange(0, TILE_N)
        in_range = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
        # [TILE_N, BLOCK_L] latents and [BLOCK_R, TILE_N] rope keys; masked entries are 0.
        c = tl.load(
            row[:, None] + lat[None, :], mask=in_range[:, None] & l_mask[None, :], other=0.0
        )
        k_pe = tl.load(
            row[None, :] + LORA + rope[:, None], mask=in_range[None, :] & r_mask[:, None], other=0.0
        )
        c = c.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, k_pe.to(q_pe.dtype), input_precision=DOT_PRECISION)
        s = tl.where(in_range[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, TILE_N]
        # Every tile holds at least one position < seq_len: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + lat[None, :],
        out,
        mask=h_mask[:, None] & l_mask[None, :],
    )


def mla_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """query [B, H, L + R] (absorbed, one token per request), kv_cache [num_blocks, block_size,
    L + R], seq_lens [B] int32 (context including this token, already stored), block_tables
    [B, >= max blocks] int32 -> [B, H, L] fp32: softmax(q . [c, k_pe] * scale) @ c per head.
    Never syncs the device."""
    num_seqs, num_heads, width = query.shape
    rope = width - kv_lora_rank
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=torch.float32, device=query.device)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("MLA decode: the query and the cache must be contiguous per row")
    upcast, precision = dot_config(query.dtype)
    block_l = max(16, triton.next_power_of_2(kv_lora_rank))
    grid = (num_seqs, triton.cdiv(num_heads, BLOCK_H))
    _mla_decode_kernel[grid](
        out,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        NUM_HEADS=num_heads,
        LORA=kv_lora_rank,
        ROPE=rope,
        BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=BLOCK_H,
        BLOCK_SIZE=kv_cache.shape[1],
        TILE_N=default_tile_n(block_l, kv_cache.dtype),
        UPCAST_DOT=upcast,
        DOT_PRECISION=precision,
        num_warps=4,
    )
    return out
