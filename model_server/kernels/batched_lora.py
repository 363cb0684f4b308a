"""Batched LoRA on CUDA with Triton (the CUDA kernel table's `lora_add`; contract in
kernels/batched_lora_torch.py): every row's own adapter in one shrink and one expand launch,
whatever the mix of adapters and base-model rows (punica's idea: group rows by adapter on the
device, never per adapter on the host).

Layouts (kernels/lora_weights.py's StackedLoRA): a [S, n R, in], b [S, R, out], ranks [S, n]
int32, slice i owning output columns [offset_i, offset_i + size_i); a/b in float32 (what the LoRA
manager gives layers off the native CPU kernel) or the model's dtype.

  shrink, grid (row tiles, n x rank tiles, split): a program takes BLOCK_M consecutive rows,
    BLOCK_R (<= 64) of slice i's R columns and one K range of `in`. The tile's rows may hold
    several slots (decodes of different adapters): it loops over the slots present (the tile's
    min..max), each a masked `tl.dot` of the tile's rows of that slot with those rows of
    A[s, i R : i R + rank] (rows past the rank read as zeros), and writes its float32 partial
    sum into h[split, row, i R : (i + 1) R] for those rows. A run of one adapter (a prefill
    chunk) is one iteration, each A tile read once per tile of rows. Few row tiles
    (decodes) split `in` over programs (the partials are summed by the expand, in a fixed order:
    deterministic, no atomics).
  expand, grid (row tiles, column tiles of `out`): per slot present, per slice the column tile
    meets, h's slice (partials summed) times B[s, :rank, columns of that slice], BLOCK_R rows of
    B at a time; the tile's sum over slots is added to out's rows once (one float32 add, one
    rounding to out's dtype).
Rows of slot -1 read and write nothing; a tile of base-model rows only returns at once. h past
a slice's rank is left unwritten where no tile reaches it, and never read.

Dots run on float32 operands: exact ("ieee") for float32 activations, TF32 for 16-bit ones
(TF32's 10-bit mantissa is fp16's, finer than bf16's: the result is rounded to those anyway).
Tile sizes are untuned: no GPU has measured them yet. Tested on CPUs under TRITON_INTERPRET=1
against the PyTorch form.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from model_server.kernels.batched_lora_torch import LoRARows
from model_server.kernels.lora_weights import StackedLoRA

MAX_BLOCK_R = 64  # ranks above run in tiles of this many (--max-lora-rank takes up to 512)
# Programs the shrink aims for before it splits `in` (about an H100's SM count).
SHRINK_PROGRAMS = 128


@triton.jit
def _tile_slots(slots_ptr, rows, T, S):
    """The tile's rows' slots (-1 past T) and the range [lo, hi] of those >= 0 (lo > hi: none)."""
    slots = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    lo = tl.min(tl.where(slots >= 0, slots, S), axis=0)
    hi = tl.max(slots, axis=0)
    return slots, lo, hi


@triton.jit
def _shrink_kernel(
    h_ptr,  # [split, T, n R] float32
    x_ptr,  # [T, K] (row stride stride_xm, unit stride along K)
    a_ptr,  # [S, n R, K] contiguous
    ranks_ptr,  # [S, n] int32
    slots_ptr,  # [T] int32, -1: base model
    T,
    K,
    S,
    R,
    N_SLICES,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    stride_xm,
    R_TILES,  # cdiv(R, BLOCK_R)
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.program_id(1) // R_TILES
    rs = (tl.program_id(1) % R_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    slots, lo, hi = _tile_slots(slots_ptr, rows, T, S)
    if hi < 0:
        return
    ks = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    width = N_SLICES * R
    h_rows = h_ptr + (split * T + rows)[:, None] * width + i * R  # h is well under 2^31
    for s in range(lo, hi + 1):
        sel = slots == s
        rank = tl.load(ranks_ptr + s * N_SLICES + i)
        if (tl.sum(sel.to(tl.int32), axis=0) > 0) & (rank > tl.min(rs, axis=0)):
            # A[s, i R + r, k] as a [BLOCK_K, BLOCK_R] tile of A^T; rows past the rank: zeros
            a_cols = a_ptr + (s * width + i * R + rs)[None, :] * K  # a: under 2^31 elements
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                k_mask = (k0 + ks) < k_end
                x = tl.load(
                    x_rows + (k0 + ks)[None, :], mask=sel[:, None] & k_mask[None, :], other=0.0
                )
                a = tl.load(
                    a_cols + (k0 + ks)[:, None],
                    mask=k_mask[:, None] & (rs < rank)[None, :],
                    other=0.0,
                )
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=DOT_PRECISION)
            tl.store(h_rows + rs[None, :], acc, mask=sel[:, None] & (rs < R)[None, :])


@triton.jit
def _expand_kernel(
    out_ptr,  # [T, N] (row stride stride_om, unit stride along N)
    h_ptr,  # [split, T, n R] float32
    b_ptr,  # [S, R, N] contiguous
    ranks_ptr,  # [S, n] int32
    bounds_ptr,  # [n + 1] int32: slice i owns columns [bounds[i], bounds[i + 1])
    slots_ptr,  # [T] int32, -1: base model
    T,
    N,
    S,
    R,
    N_SLICES,
    SPLIT,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    slots, lo, hi = _tile_slots(slots_ptr, rows, T, S)
    if hi < 0:
        return
    width = N_SLICES * R
    h_rows = h_ptr + rows[:, None] * width  # h is well under 2^31 elements
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # rows of every slot, disjoint
    for s in range(lo, hi + 1):
        sel = slots == s
        if tl.sum(sel.to(tl.int32), axis=0) > 0:
            b_slot = b_ptr + s * R * N  # b: under 2^31 elements
            for i in range(0, N_SLICES):
                first = tl.load(bounds_ptr + i)
                end = tl.load(bounds_ptr + i + 1)
                rank = tl.load(ranks_ptr + s * N_SLICES + i)
                if (rank > 0) & (first < col0 + BLOCK_N) & (end > col0):
                    col_mask = (cols >= first) & (cols < end)
                    for r0 in range(0, rank, BLOCK_R):
                        rs = r0 + tl.arange(0, BLOCK_R)
                        r_mask = rs < rank
                        h_mask = sel[:, None] & r_mask[None, :]
                        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                        for p in range(0, SPLIT):
                            h += tl.load(
                                h_rows + p * T * width + i * R + rs[None, :],
                                mask=h_mask,
                                other=0.0,
                            )
                        b = tl.load(
                            b_slot + rs[:, None] * N + cols[None, :],
                            mask=r_mask[:, None] & col_mask[None, :],
                            other=0.0,
                        )
                        acc += tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = (slots >= 0)[:, None] & (cols < N)[None, :]
    total = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)


@lru_cache(maxsize=64)
def _slice_bounds(slices: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """[n + 1] int32 on `device`: the slices' first columns, then the output's width (made once
    per layer shape: a model has a few)."""
    bounds = [offset for offset, _ in slices] + [slices[-1][0] + slices[-1][1]]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _check(x: torch.Tensor, slots: torch.Tensor, stacked: StackedLoRA) -> None:
    if x.dim() != 2 or x.shape[1] != stacked.a.shape[2]:
        raise ValueError(f"batched LoRA: x {tuple(x.shape)} for A {tuple(stacked.a.shape)}")
    if slots.dtype != torch.int32 or slots.shape != (x.shape[0],) or slots.device != x.device:
        raise ValueError(f"batched LoRA: slots {tuple(slots.shape)} {slots.dtype} {slots.device}")
    for t in (stacked.a, stacked.b, stacked.ranks):
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(
                "batched LoRA: the slots must be contiguous on the activations' device"
            )
    if max(stacked.a.numel(), stacked.b.numel()) >= 2**31:  # the kernels index them in int32
        raise ValueError("batched LoRA: slots too large for int32 indexing")


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(num_rows: int) -> int:
    return 16 if num_rows <= 16 else 64


def _block_r(max_rank: int) -> int:
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(max_rank)))  # tl.dot: dims >= 16


def lora_shrink(
    x: torch.Tensor,
    slots: torch.Tensor,
    stacked: StackedLoRA,
    *,
    split: int | None = None,
    block_k: int = 64,
) -> torch.Tensor:
    """h [split, T, n R] float32: summed over its first dimension, row t's slice i columns
    [i R, i R + rank) are x[t] A[slot_t, i R : i R + rank]^T (zeros up to (i + 1) R). Rows of
    slot -1 and slices of rank 0 are not written (h is uninitialised there)."""
    _check(x, slots, stacked)
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, k = x.shape
    n_slices, r = len(stacked.slices), stacked.max_rank
    if num_rows == 0:
        return torch.empty((1, 0, n_slices * r), dtype=torch.float32, device=x.device)
    block_m = _block_m(num_rows)
    row_tiles = triton.cdiv(num_rows, block_m)
    block_r = _block_r(r)
    r_tiles = triton.cdiv(r, block_r)
    if split is None:  # enough programs to fill the GPU when few row tiles run (decodes)
        programs = row_tiles * n_slices * r_tiles
        split = max(1, min(triton.cdiv(k, 4 * block_k), SHRINK_PROGRAMS // programs))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    if split * num_rows * n_slices * r >= 2**31:  # the kernels index h in int32
        raise ValueError(f"batched LoRA: {num_rows} rows too many for int32 indexing")
    h = torch.empty((split, num_rows, n_slices * r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(row_tiles, n_slices * r_tiles, split)](
        h,
        x,
        stacked.a,
        stacked.ranks,
        slots,
        num_rows,
        k,
        stacked.max_loras,
        r,
        n_slices,
        k_per_split,
        x.stride(0),
        r_tiles,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        DOT_PRECISION=_precision(x.dtype),
        num_warps=4,
    )
    return h


def lora_expand(
    h: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    stacked: StackedLoRA,
    *,
    block_n: int = 64,
) -> None:
    """out[t, slice i] += (sum over h's splits)[t, slice i] B[slot_t, :rank, slice i's columns]
    for every row t of slot >= 0, in place (float32 sum, one rounding to out's dtype)."""
    split, num_rows, width = h.shape
    n_out = stacked.b.shape[2]
    if out.shape != (num_rows, n_out) or out.stride(-1) != 1 or h.dtype != torch.float32:
        raise ValueError(f"batched LoRA: out {tuple(out.shape)} for h {tuple(h.shape)}")
    if width != stacked.a.shape[1] or not h.is_contiguous():
        raise ValueError(f"batched LoRA: h {tuple(h.shape)} for A {tuple(stacked.a.shape)}")
    if num_rows == 0:
        return
    block_m = _block_m(num_rows)
    r = stacked.max_rank
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n_out, block_n))
    _expand_kernel[grid](
        out,
        h,
        stacked.b,
        stacked.ranks,
        _slice_bounds(stacked.slices, out.device),
        slots,
        num_rows,
        n_out,
        stacked.max_loras,
        r,
        len(stacked.slices),
        split,
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=_block_r(r),
        DOT_PRECISION=_precision(out.dtype),
        num_warps=4,
    )


def lora_add_triton(
    x: torch.Tensor, out: torch.Tensor, rows: LoRARows, stacked: StackedLoRA
) -> None:
    """`KernelTable.lora_add` (kernels/batched_lora_torch.py's contract): one shrink and one
    expand launch over all rows, grouped by `rows.slots` on the device."""
    lora_expand(lora_shrink(x, rows.slots, stacked), out, rows.slots, stacked)
