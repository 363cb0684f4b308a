"""wNa16 matmul (w4a16 / w8a16 with group scales) for GPTQ and AWQ checkpoints on CUDA:
y = x @ W^T + b, W read in the wNa16 layout of kernels/portable.py (uint8 codes, 4-bit ones two
per byte in blocks of 32 along K; float32 scales and offsets [N, G], G = ceil(K / group_size)).

Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): a program walks K in steps of BLOCK_K (a multiple of
32 dividing the group size, so a step lies in one group), loads the codes of a [BLOCK_K,
BLOCK_N] tile of W^T (half a byte or a byte per weight from memory), dequantizes them in
registers with the step's group scale and offset (q * scale + offset, fp32) into x's dtype and
accumulates `tl.dot` in fp32. Decode steps (M <= 16) use narrow N tiles (32 columns). These
tile sizes are untuned: no GPU has measured them yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import dot_config
from model_server.kernels.portable import wna16_linear_dequant


@triton.jit
def _wna16_linear_kernel(
    out_ptr,  # [M, N], x's dtype
    x_ptr,  # [M, K] (row stride stride_xm, unit stride along K)
    codes_ptr,  # [N, K * BITS / 8] uint8, contiguous
    scales_ptr,  # [N, G] float32
    offsets_ptr,  # [N, G] float32
    bias_ptr,  # [N] (used when HAS_BIAS)
    M,
    N,
    K,
    G,
    group_size,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    row_bytes = K * BITS // 8
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = codes_ptr + cols.to(tl.int64)[None, :] * row_bytes
    if BITS == 4:
        # Byte of k within its row: block k // 32, byte (k % 32) % 16; nibble (k % 32) // 16.
        byte_of_k = (ks // 32) * 16 + (ks % 32) % 16
        shift = ((ks % 32) // 16) * 4
    else:
        byte_of_k = ks
        shift = ks * 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(
            x_rows + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        start = k0 * BITS // 8
        b = tl.load(
            w_cols + (start + byte_of_k)[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0,
        ).to(tl.int32)
        q = (b >> shift[:, None]) & ((1 << BITS) - 1)  # [BLOCK_K, BLOCK_N]
        g = k0 // group_size
        s = tl.load(scales_ptr + cols.to(tl.int64) * G + g, mask=col_mask, other=0.0)
        o = tl.load(offsets_ptr + cols.to(tl.int64) * G + g, mask=col_mask, other=0.0)
        w = q.to(tl.float32) * s[None, :] + o[None, :]
        if UPCAST_DOT:
            x = x.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def wna16_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantized(W)^T + bias -> new [M, N] in x's dtype
    (`KernelTable.wna16_linear`)."""
    m, k = x.shape
    n = codes.shape[0]
    if group_size % 32:  # per-channel 8-bit with K not a multiple of 32
        return wna16_linear_dequant(x, codes, scales, offsets, bits, group_size, bias)
    if bits not in (4, 8) or codes.shape[1] * 8 // bits != k:
        raise ValueError(
            f"wna16_linear: x {tuple(x.shape)}, codes {tuple(codes.shape)}, bits {bits}, "
            f"group {group_size} do not match"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    decode = m <= 16
    block_m = block_m or (16 if decode else 64)
    block_n = block_n or (32 if decode else 128)
    # A step of K lies in one group: the largest of 128 (decode), 64, 32 dividing the group
    # size. Prefill tiles stop at 64: 64 x 128 fp32 tiles with 128 of K need 162 KiB of shared
    # memory, more than sm_89's 99 (tools/compile_check.py).
    block_k = next(b for b in ((128, 64, 32) if decode else (64, 32)) if group_size % b == 0)
    upcast_dot, dot_precision = dot_config(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wna16_linear_kernel[grid](
        out,
        x,
        codes.contiguous(),
        scales.contiguous(),
        offsets.contiguous(),
        out if bias is None else bias,
        m,
        n,
        k,
        triton.cdiv(k, group_size),
        group_size,
        x.stride(0),
        out.stride(0),
        BITS=bits,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        num_warps=4,
    )
    return out
