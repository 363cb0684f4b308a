"""Weight-only int8 matmul (w8a16) for `--quantization int8` on CUDA: y = x @ (s * Q)^T + b.

x [M, K] in the model dtype; Q [N, K] int8 codes and s [N] per-row scales (bf16 as
layers/quantization/ stores them, or float32), widened to float32 in the kernel.
Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): a program loads int8 tiles of Q (1 byte per weight
from memory, half of bf16's), converts them to x's dtype in registers, accumulates `tl.dot` in
fp32 over K, then applies the scales (and bias) once per output column.
Decode steps (M <= 16) use narrow N tiles (32 columns): a 4096-wide layer is 128 programs,
about one per H100 SM. These tile sizes are untuned: no GPU has measured them yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_server.kernels.attention_tile import dot_config


@triton.jit
def _int8_linear_kernel(
    out_ptr,  # [M, N], x's dtype
    x_ptr,  # [M, K] (row stride stride_xm, unit stride along K)
    qweight_ptr,  # [N, K] int8, contiguous
    scale_ptr,  # [N] bf16 or float32
    bias_ptr,  # [N] (used when HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # compute the dot in fp32 (see attention_tile.dot_config)
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = qweight_ptr + cols.to(tl.int64)[None, :] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x_mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=x_mask, other=0.0)
        # [BLOCK_K, BLOCK_N] of Q^T: codes are exact in bf16/fp16/fp32.
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        if UPCAST_DOT:
            x = x.to(tl.float32)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ (scale[:, None] * qweight)^T + bias -> new [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k or qweight.dtype != torch.int8 or scale.shape != (n,):
        raise ValueError(
            f"int8_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)} {qweight.dtype}, "
            f"scale {tuple(scale.shape)} do not match"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight = qweight.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    decode = m <= 16
    block_m = block_m or (16 if decode else 64)
    block_n = block_n or (32 if decode else 128)
    block_k = block_k or (256 if decode else 64)
    upcast_dot, dot_precision = dot_config(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](
        out,
        x,
        qweight,
        scale,
        out if bias is None else bias,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST_DOT=upcast_dot,
        DOT_PRECISION=dot_precision,
        num_warps=4,
    )
    return out
