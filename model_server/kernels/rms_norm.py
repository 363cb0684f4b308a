"""RMSNorm and residual-add + RMSNorm in one pass over each row (what `layers/norm.py` computes
in ~8 PyTorch kernels, each reading and writing the whole [T, hidden] activation).

One program per row. A row of up to `_MAX_BLOCK_N` elements (8192: hidden sizes up to Llama-70B)
is one tile held in registers: x (and the residual) are read once, the output (and the new
residual) written once. Longer rows loop over tiles twice: a first pass sums the squares (and
writes the new residual), a second recomputes each tile from the inputs and writes it normalised
(it re-reads the inputs rather than the freshly written residual, so no program ever reads its own
stores).

Numerics are those of `layers.norm.RMSNorm` (HF Llama):
  - the residual sum is rounded to its dtype (`x + residual` in PyTorch: fp32 add, one rounding),
    and the statistics are computed from that rounded sum;
  - mean(s^2) and rsqrt in float32;
  - the normalised value is rounded to the sum's dtype BEFORE the weight multiply, then
    `weight * normed` rounds once more to the promoted dtype (the product of two bf16/fp16 values
    is exact in fp32, so this matches PyTorch's opmath multiply).
What may differ from PyTorch: the order of the fp32 sum of squares and the rsqrt implementation
(approximate on GPUs): a few fp32 ulps of the per-row scale, which can flip the bf16/fp16
rounding of a rare element by one ulp.

Outputs are new contiguous buffers; inputs are never written (under CUDA graphs they are static
buffers, and the decoder's first layer passes its embedding output as both input and residual).

Row addressing: inputs may be [N], [R, N] with any row stride, or [A, B, N] with any strides on
A and B (Qwen3's q/k norm normalises per-head views of the fused qkv projection), always with unit
stride along N: row r starts at (r // B) * stride_outer + (r % B) * stride_inner. A 2-D input (or
a 3-D one whose two leading dims merge) is passed as B = 1. Other layouts are copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Longest row kept in one register tile; longer rows take the two-pass loop.
_MAX_BLOCK_N = 8192


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R, N] contiguous: weight * normed
    residual_out_ptr,  # [R, N] contiguous: s = x + residual (used when HAS_RESIDUAL)
    x_ptr,  # R rows of N, addressed as in the module docstring, unit stride along N
    residual_ptr,  # like x (used when HAS_RESIDUAL)
    weight_ptr,  # [N] contiguous
    inner_rows,  # B: rows per outer index (1 for 2-D inputs)
    stride_x_outer: tl.int64,
    stride_x_inner: tl.int64,
    stride_r_outer: tl.int64,
    stride_r_inner: tl.int64,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,  # power of two; N <= BLOCK_N means one tile
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    x_row = x_ptr + outer * stride_x_outer + inner * stride_x_inner
    r_row = residual_ptr + outer * stride_r_outer + inner * stride_r_inner
    out_row = out_ptr + row * N
    res_out_row = residual_out_ptr + row * N
    # The dtype the normalised value is rounded to: the sum's with a residual, else x's.
    if HAS_RESIDUAL:
        norm_dtype = residual_out_ptr.dtype.element_ty
    else:
        norm_dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)

    if N <= BLOCK_N:
        mask = cols < N
        s = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + cols, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(norm_dtype)
            tl.store(res_out_row + cols, s, mask=mask)
        s32 = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s32 * s32, 0) / N + eps)
        w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
        normed = (s32 * rstd).to(norm_dtype).to(tl.float32)
        tl.store(out_row + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            s = tl.load(x_row + start + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + start + cols, mask=mask, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(norm_dtype)
                tl.store(res_out_row + start + cols, s, mask=mask)
            s32 = s.to(tl.float32)
            acc += s32 * s32
        rstd = tl.rsqrt(tl.sum(acc, 0) / N + eps)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            s = tl.load(x_row + start + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + start + cols, mask=mask, other=0.0)
                s = (s.to(tl.float32) + r.to(tl.float32)).to(norm_dtype)
            w = tl.load(weight_ptr + start + cols, mask=mask).to(tl.float32)
            normed = (s.to(tl.float32) * rstd).to(norm_dtype).to(tl.float32)
            tl.store(out_row + start + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t or a copy, inner_rows B, stride_outer, stride_inner) addressing t's rows as the kernel
    does; t has at least one row and N > 0."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 0, 0
    if t.dim() > 3:
        t = t.reshape(-1, *t.shape[-2:])  # a view when the leading dims merge, else a copy
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    a, b, _ = t.shape
    # [A, B, N] whose rows are evenly spaced is addressed with one row stride.
    if b == 1:
        return t, 1, t.stride(0), 0
    if a == 1 or t.stride(0) == b * t.stride(1):
        return t, 1, t.stride(1), 0
    return t, b, t.stride(0), t.stride(1)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}; "
            "they must match (no broadcasting)"
        )
    norm_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(norm_dtype, weight.dtype), device=x.device)
    residual_out = (
        None if residual is None else torch.empty(x.shape, dtype=norm_dtype, device=x.device)
    )
    num_rows = x.numel() // n if n else 0
    if num_rows == 0:
        return out, residual_out
    weight = weight.contiguous()
    x, inner_rows, stride_x_outer, stride_x_inner = _row_layout(x)
    if residual is None:
        r, stride_r_outer, stride_r_inner = x, 0, 0  # unused
    else:
        r, r_inner, stride_r_outer, stride_r_inner = _row_layout(residual)
        if r_inner != inner_rows:  # one strided, one contiguous: address both alike
            x, r = x.contiguous(), r.contiguous()
            inner_rows, stride_x_outer, stride_r_outer = 1, n, n
            stride_x_inner = stride_r_inner = 0
    block_n = min(triton.next_power_of_2(n), _MAX_BLOCK_N)
    _rms_norm_kernel[(num_rows,)](
        out,
        out if residual_out is None else residual_out,
        x,
        r,
        weight,
        inner_rows,
        stride_x_outer,
        stride_x_inner,
        stride_r_outer,
        stride_r_inner,
        eps,
        N=n,
        BLOCK_N=block_n,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block_n // 256, 1), 16),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * rms_normalised(x), a new contiguous tensor of x's shape.

    Same numerics and output dtype (x's promoted with weight's) as `layers.norm.RMSNorm`.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (same shapes) -> (rms_norm(s, weight, eps), s), both new tensors.

    `RMSNorm.forward(x, residual)`'s contract; x and residual are left untouched.
    """
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
