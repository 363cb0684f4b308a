"""SiluAndMul in one pass: x [..., 2d] -> silu(x[..., :d]) * x[..., d:] (the gated MLP of Llama,
Mistral and Qwen), where PyTorch runs chunk + silu + mul and writes the [T, d] silu in between.

Grid: (rows, cdiv(d, BLOCK_D)). Each program reads one tile of the gate and the matching tile of
up from its row and writes one tile of the output: every element is read and written once.

Numerics follow `F.silu(gate) * up` in PyTorch for bf16/fp16: silu is computed in float32 as
gate / (1 + exp(-gate)) and rounded to the input dtype (F.silu's opmath), then multiplied by up
in float32 and rounded again (the product of two bf16/fp16 values is exact in fp32, so this is
PyTorch's mul). What differs: exp and the division are Triton's (approximate on GPUs, a few fp32
ulps) rather than PyTorch's, which can flip the rounding of the silu (or of the product) of a
rare element by one bf16/fp16 ulp; in fp32 the results agree to a few ulps.

Rows need unit stride along the last dim and any row stride (the gate_up projection's output is
contiguous); other layouts are reshaped (a copy when the leading dims do not merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of the output per program; wider activations take several programs per row.
_MAX_BLOCK_D = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [R, D] contiguous
    x_ptr,  # [R, 2 * D]: gate | up, unit stride along the last dim
    stride_x_row: tl.int64,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (silu * up).to(out_dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]: a new contiguous [..., d] tensor of x's
    dtype; x is not written."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is odd; expected [..., 2 * d]")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, 2 * d)  # a view for the model's 2-D input
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block_d = min(triton.next_power_of_2(d), _MAX_BLOCK_D)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block_d))](
        out,
        rows,
        rows.stride(0),
        D=d,
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 512 else 1,
    )
    return out
