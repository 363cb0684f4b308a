"""The CUDA platform's `varlen_attention` slot (kernels/varlen_attention.py has the contract): a
pooling step's packed sequences, each attending over its own tokens, in one Triton launch with a
flash-attention online softmax. No padding and no mask tensor: a step of sentences of mixed
lengths computes about sum(len^2) scores, not B * longest^2.

Grid: (query tiles of all sequences, num_kv_heads). A program takes BLOCK_Q tokens of one
sequence and the `G = num_heads // num_kv_heads` query heads that share one KV head, packed as the
BLOCK_M = BLOCK_Q * G rows of `tl.dot` (row r is token r // G, head r % G; as in
paged_prefill.py), so each K/V tile is loaded once per KV head. The tiles are listed on the host
from `cu_seqlens` (which the contract puts on the CPU): tile i is query tile `tile_idx[i]` of
sequence `tile_seq[i]`, so empty sequences take no program and short ones exactly as many as they
fill. cu_seqlens and that table travel to the device in one copy per call (pooling steps are never
captured in device graphs: their shapes change every step).

q, k, v are read in place: any row stride (views of a fused qkv projection), unit stride along the
columns, head h at columns h * D .. h * D + D. Head dims that are not powers of two (80, 96; the
32 of MiniLM and 64 of bge-base are) are masked up to BLOCK_D, the next power of two. Scores,
softmax and the P @ V sums are fp32; the dots take fp32 (exact, not TF32), bf16 or fp16 operands
as `dot_config` says. Causal tiles (decoder embedding models) split the key loop as paged_prefill
does: key tiles wholly before the query tile's first token need no mask, the diagonal ones are
masked per row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import default_tile_n, dot_config

LOG2E = math.log2(math.e)
# Rows per program (query tokens x the GQA group): 64, as paged prefill measured best on H100.
_BLOCK_M = 64
# Bytes of the Q tile the default row count stays within: fp32 at D 256 (64 KiB at 64 rows) took
# 100 KiB of shared memory per program, past the 99 KiB of sm_86/sm_89 (compile-only check).
_MAX_Q_TILE_BYTES = 32 * 1024


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, BLOCK_D] query rows (compute dtype; padded rows are zeros)
    m_i,  # [BLOCK_M] fp32 running max of the log2-scaled scores
    l_i,  # [BLOCK_M] fp32 running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, BLOCK_D] fp32 running sum of p @ V
    k_base,  # K row of the sequence's first token, at this KV head's columns
    v_base,  # likewise for V
    tile_start,  # first key (token index within the sequence) of the tile
    kv_end,  # keys >= kv_end are masked out (the sequence's end)
    q_idx,  # [BLOCK_M] token index of each query row within the sequence (read when CAUSAL)
    qk_scale,  # softmax scale * log2(e)
    stride_k,
    stride_v,
    dims,  # tl.arange(0, BLOCK_D)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = tile_start + tl.arange(0, TILE_N)
    in_range = pos < kv_end
    rows = pos.to(tl.int64)
    if HEAD_DIM == BLOCK_D:
        # No mask along head_dim keeps the mask constant along the contiguous axis (vector loads).
        k_mask = in_range[None, :]
        v_mask = in_range[:, None]
    else:
        d_mask = dims < HEAD_DIM
        k_mask = in_range[None, :] & d_mask[:, None]
        v_mask = in_range[:, None] & d_mask[None, :]

    # K^T tile [BLOCK_D, TILE_N]; masked entries are 0, never the next sequence's rows.
    k = tl.load(k_base + rows[None, :] * stride_k + dims[:, None], mask=k_mask, other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if CAUSAL:
        valid = in_range[None, :] & (pos[None, :] <= q_idx[:, None])
    else:
        valid = in_range[None, :]
    s = tl.where(valid, s, float("-inf"))

    # Every row sees key 0 in the first tile the caller passes (tile 0), so m_new is finite from
    # then on and exp2 never meets -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_base + rows[:, None] * stride_v + dims[None, :], mask=v_mask, other=0.0)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _varlen_attention_kernel(
    out_ptr,  # [T, Hq * D] contiguous
    q_ptr,  # [T, Hq * D], row stride stride_q
    k_ptr,  # [T, Hkv * D], row stride stride_k
    v_ptr,  # [T, Hkv * D], row stride stride_v
    cu_seqlens_ptr,  # [B + 1] int32: sequence s owns rows cu[s]:cu[s + 1]
    tile_seq_ptr,  # [num_tiles] int32: the sequence of each program's query tile
    tile_idx_ptr,  # [num_tiles] int32: the tile's index within its sequence
    qk_scale,  # softmax scale * log2(e)
    stride_q: tl.int64,
    stride_k: tl.int64,
    stride_v: tl.int64,
    stride_o: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= HEAD_DIM, >= 16
    BLOCK_M: tl.constexpr,  # power of two >= BLOCK_Q * NUM_QUERIES_PER_KV, >= 16
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per inner step, >= 16
    CAUSAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # compute the dots in fp32 (see dot_config)
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_tile = tl.load(tile_idx_ptr + tile)
    start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # token within the sequence
    heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < seq_len)
    dims = tl.arange(0, BLOCK_D)
    io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    tok = (start + q_idx).to(tl.int64)  # [BLOCK_M] packed row
    col = heads.to(tl.int64) * HEAD_DIM

    # [BLOCK_M, BLOCK_D]; padded rows are zeros (their scores are finite, results discarded).
    q = tl.load(
        q_ptr + tok[:, None] * stride_q + col[:, None] + dims[None, :], mask=io_mask, other=0.0
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # K, V and P follow q's dtype in _attend_tile
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    kv_col = kv_head.to(tl.int64) * HEAD_DIM
    k_base = k_ptr + start.to(tl.int64) * stride_k + kv_col
    v_base = v_ptr + start.to(tl.int64) * stride_v + kv_col
    if CAUSAL:
        first_q = q_tile * BLOCK_Q
        # Keys this tile can see: up to its last query token.
        kv_end = tl.minimum(seq_len, first_q + BLOCK_Q)
        # Tiles wholly at keys <= first_q are visible to every row: no causal mask.
        num_full_tiles = (first_q + 1) // TILE_N
    else:
        kv_end = seq_len
        num_full_tiles = tl.cdiv(seq_len, TILE_N)
    for t in range(num_full_tiles):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, v_base, t * TILE_N, kv_end, q_idx, qk_scale, stride_k,
            stride_v, dims, HEAD_DIM, BLOCK_D, TILE_N, False, DOT_PRECISION,
        )  # fmt: skip
    if CAUSAL:
        for t in range(num_full_tiles, tl.cdiv(kv_end, TILE_N)):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_base, v_base, t * TILE_N, kv_end, q_idx, qk_scale, stride_k,
                stride_v, dims, HEAD_DIM, BLOCK_D, TILE_N, True, DOT_PRECISION,
            )  # fmt: skip

    acc = acc / l_i[:, None]
    out = out_ptr + tok[:, None] * stride_o + col[:, None] + dims[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def default_block_m(block_d: int, dtype: torch.dtype) -> int:
    """Rows per program: 64, halved (down to 16) while the Q tile of `block_d` columns in `dtype`
    would exceed 32 KiB (only fp32 past D 128). The launch raises it to the GQA group if larger."""
    block_m = _BLOCK_M
    elt = torch.empty((), dtype=dtype).element_size()
    while block_m > 16 and block_m * block_d * elt > _MAX_Q_TILE_BYTES:
        block_m //= 2
    return block_m


def _columns_contiguous(t: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """t as a [T, width] tensor with unit column stride (a copy only where it has none)."""
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"varlen attention: {name} must be [T, {width}], got {tuple(t.shape)}")
    return t if t.stride(1) == 1 or width == 1 else t.contiguous()


def _tile_table(
    cu_seqlens: torch.Tensor, total_rows: int, block_q: int
) -> tuple[torch.Tensor, int]:
    """(cu_seqlens, tile_seq, tile_idx) concatenated as one int32 CPU tensor, and the number of
    tiles: each sequence's cdiv(len, block_q) query tiles in order."""
    if cu_seqlens.dtype != torch.int32 or not cu_seqlens.is_cpu or cu_seqlens.dim() != 1:
        raise ValueError("varlen attention: cu_seqlens must be a 1-D int32 CPU tensor")
    if cu_seqlens.shape[0] < 1 or int(cu_seqlens[0]) < 0 or int(cu_seqlens[-1]) > total_rows:
        raise ValueError(f"varlen attention: cu_seqlens must lie within the {total_rows} rows")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    if bool((lengths < 0).any()):
        raise ValueError("varlen attention: cu_seqlens must not decrease")
    tiles = (lengths + block_q - 1) // block_q
    num_tiles = int(tiles.sum())
    tile_seq = torch.repeat_interleave(
        torch.arange(lengths.shape[0], dtype=torch.int32), tiles, output_size=num_tiles
    )
    first = torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles, output_size=num_tiles)
    tile_idx = (torch.arange(num_tiles, dtype=torch.int64) - first).to(torch.int32)
    return torch.cat([cu_seqlens, tile_seq, tile_idx]), num_tiles


def varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    causal: bool = False,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """The slot's contract (kernels/varlen_attention.py): q [T, Hq * D], k, v [T, Hkv * D] on
    one device, `cu_seqlens` [B + 1] int32 on the CPU; returns a new [T, Hq * D] in q's dtype
    (rows outside every sequence are left unwritten, as the portable version leaves them).

    `block_m` (rows per program, query tokens times the GQA group) and `tile_n` (keys per inner
    step) override the defaults; tests use small ones to cross tile edges with short sequences.
    """
    for name, size in (("block_m", block_m), ("tile_n", tile_n)):
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"varlen attention: {name} must be a power of two >= 16, not {size}")
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"varlen attention: q, k and v must share a dtype ({dtype})")
    if k.device != q.device or v.device != q.device:
        raise ValueError("varlen attention: q, k and v must be on one device")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads or q.shape[1] % num_heads:
        raise ValueError(
            f"varlen attention: {q.shape[1]} query values are not {num_heads} heads over "
            f"{num_kv_heads} kv heads"
        )
    d = q.shape[1] // num_heads
    total = q.shape[0]
    q = _columns_contiguous(q, num_heads * d, "q")
    k = _columns_contiguous(k, num_kv_heads * d, "k")
    v = _columns_contiguous(v, num_kv_heads * d, "v")
    if k.shape[0] != total or v.shape[0] != total:
        raise ValueError("varlen attention: q, k and v must have the same rows")
    out = q.new_empty((total, num_heads * d))

    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(block_m or default_block_m(block_d, dtype), 16, triton.next_power_of_2(group))
    block_q = block_m // group
    table, num_tiles = _tile_table(cu_seqlens, total, block_q)
    if num_tiles == 0 or d == 0:
        return out
    num_seqs = cu_seqlens.shape[0] - 1
    table = table.to(q.device)  # the step's one host-to-device copy
    cu_dev = table[: num_seqs + 1]
    tile_seq = table[num_seqs + 1 : num_seqs + 1 + num_tiles]
    tile_idx = table[num_seqs + 1 + num_tiles :]

    if tile_n is None:
        tile_n = default_tile_n(block_d, dtype)
    upcast_dot, dot_precision = dot_config(dtype)
    _varlen_attention_kernel[(num_tiles, num_kv_heads)](
        out, q, k, v, cu_dev, tile_seq, tile_idx, scale * LOG2E,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0),
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        CAUSAL=bool(causal),
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        # 4 warps for 64-row tiles up to D 128 (paged prefill's measurement); more registers past.
        num_warps=4 if block_m * block_d <= 64 * 128 else 8,
        num_stages=2,
    )  # fmt: skip
    return out
