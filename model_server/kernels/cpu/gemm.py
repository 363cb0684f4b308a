"""The native skinny matmul (kernels/cpu/gemm.c) behind F.linear's contract: `gemm_linear`, a
candidate of the CPU linear tuner (kernels/cpu/linear_tuning.py) for decode's few rows.

x [..., K] @ weight [N, K]^T + bias [N] -> a new contiguous [..., N] in x's dtype, x, weight and
bias all fp32 or all bf16, fp32 accumulation; inputs are never written. Other inputs (another
dtype, a non-contiguous weight, another device) go to F.linear, so a plan that chose this kernel
serves any call; `gemm_applies` says where the kernel itself runs.

A call costs about 5 us of Python and ctypes besides the kernel (F.linear: about 3), so the
checks below are kept to cheap attribute reads.
"""

from __future__ import annotations

import struct
from functools import cache

import torch
import torch.nn.functional as F

from model_server.kernels.cpu import native

# wick_gemm's arguments, in its order, as wick_gemm_packed reads them.
_ARGS = struct.Struct("=12q")
# Multiply-adds that justify one more thread: smaller matmuls run on fewer threads than torch's.
# On a Zen 4 with 2 threads, a second thread took 10% off 37K multiply-adds (one row of 576x64,
# ~10 us), 24% off 111K and 40-45% from 332K on (one row of SmolLM2's o_proj), when it got a
# core at once; on a loaded machine a fork/join can wait a scheduler tick for a descheduled
# thread, which only a large matmul can afford to risk.
MIN_WORK_PER_THREAD = 1 << 17


@cache
def default_kernels() -> native.NativeKernels | None:
    """The process's build (`native.load_kernels()`), looked up once: the lookup costs more than
    a small matmul's Python overhead."""
    return native.load_kernels()


def gemm_applies(weight: torch.Tensor, kernels: native.NativeKernels | None = None) -> bool:
    """Whether the native kernel runs for this weight (the dtype, the layout, a built library);
    builds the library on first call."""
    if not weight.is_cpu or weight.dtype not in native.DTYPE_CODES:
        return False
    if weight.dim() != 2 or not weight.is_contiguous():
        return False
    return (kernels or default_kernels()) is not None


def gemm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
    use_dpbf16: bool = True,
) -> torch.Tensor:
    """F.linear on the native skinny matmul: weight [N, K] streamed once for all of x's rows, on
    up to torch's thread count (fewer for a small matmul; 0 `min_work_per_thread`: all).
    `use_dpbf16`: bf16 on vdpbf16ps where the build has it, from 4 rows of x (else the shift
    path; see gemm.c)."""
    if x.dim() != 2:  # [..., K] -> [..., N] through the 2-D kernel
        out = gemm_linear(
            x.reshape(-1, x.shape[-1]), weight, bias, kernels, min_work_per_thread, use_dpbf16
        )
        return out.view(*x.shape[:-1], weight.shape[0])
    code = native.DTYPE_CODES.get(x.dtype)
    m, k = x.shape
    n = weight.shape[0]
    if (
        code is None
        or weight.dtype != x.dtype
        or weight.dim() != 2
        or weight.shape[1] != k
        or not (x.is_cpu and weight.is_cpu and weight.is_contiguous())
        or (bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or not bias.is_cpu))
    ):
        return F.linear(x, weight, bias)
    kernels = kernels or default_kernels()
    if kernels is None:
        return F.linear(x, weight, bias)
    # Rows may be apart (a slice of wider rows); within a row the elements must be adjacent.
    row_stride, col_stride = x.stride()
    if col_stride != 1 and k > 1:
        x = x.contiguous()
        row_stride = k
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = x.new_empty((m, n))
    # One packed argument (wick_gemm_packed): ctypes converts each argument for ~0.15 us.
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    status = kernels.lib.wick_gemm_packed(
        _ARGS.pack(
            code,
            x.data_ptr(),
            row_stride,
            weight.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            use_dpbf16,
            torch.get_num_threads(),
            min_work_per_thread,
        )
    )
    if status != 0:
        raise MemoryError("the native matmul could not allocate its scratch buffer")
    return out
