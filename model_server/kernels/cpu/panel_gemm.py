"""The bf16 matmul on panel-packed weights (kernels/cpu/panel_gemm.c): a candidate of the CPU
linear tuner (kernels/cpu/linear_tuning.py) at every row count, on builds with AVX512-BF16.

`pack_panels(weight)` re-lays a bf16 weight [N, K] out once (the same bytes, rounded up to whole
panels of 16 outputs and pairs of K); `panel_linear(x, panels, bias)` is F.linear's contract on
it: x [M, K] bf16 @ W^T + bias -> a new [M, N] bf16, fp32 accumulation, inputs never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD, default_kernels


@dataclass(slots=True, frozen=True)
class Panels:
    """A weight [n, k] in the panel layout (see panel_gemm.c): `data` holds the values."""

    data: torch.Tensor  # 1-D bf16, wick_panel_elements(n, k) values
    n: int
    k: int


def panels_available(kernels: native.NativeKernels | None = None) -> bool:
    """Whether this CPU's build has the kernel (AVX512-BF16); builds the library on first call."""
    kernels = kernels or default_kernels()
    return kernels is not None and bool(kernels.lib.wick_panel_gemm_available())


def pack_panels(weight: torch.Tensor, kernels: native.NativeKernels | None = None) -> Panels:
    """weight [N, K] bf16 -> its panels. Raises ValueError where the kernel cannot run it (another
    dtype, not a CPU matrix, a build without AVX512-BF16)."""
    kernels = kernels or default_kernels()
    if kernels is None or not kernels.lib.wick_panel_gemm_available():
        raise ValueError("the panel matmul needs a native build with AVX512-BF16")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_cpu:
        raise ValueError(
            f"the panel matmul takes a 2-D bf16 CPU weight, not {weight.dtype} {weight.shape}"
        )
    weight = weight.detach().contiguous()
    n, k = weight.shape
    data = torch.empty(kernels.lib.wick_panel_elements(n, k), dtype=torch.bfloat16)
    kernels.lib.wick_panel_pack(weight.data_ptr(), n, k, data.data_ptr())
    return Panels(data, int(n), int(k))


def panel_linear(
    x: torch.Tensor,
    panels: Panels,
    bias: torch.Tensor | None = None,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
) -> torch.Tensor:
    """x [..., K] bf16 @ W^T + bias [N] bf16 -> [..., N] bf16, W given by its panels; on up to
    torch's thread count (fewer for small matmuls; 0 `min_work_per_thread`: all)."""
    if x.dim() != 2:
        out = panel_linear(x.reshape(-1, x.shape[-1]), panels, bias, kernels, min_work_per_thread)
        return out.view(*x.shape[:-1], panels.n)
    m, k = x.shape
    if x.dtype != torch.bfloat16 or k != panels.k or not x.is_cpu:
        raise ValueError(
            f"panel matmul: x must be bf16 [M, {panels.k}] on the CPU, not {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (panels.n,)):
        raise ValueError(f"panel matmul: bias must be bf16 [{panels.n}]")
    kernels = kernels or default_kernels()
    if kernels is None:
        raise ValueError("the panel matmul needs the native kernels")
    row_stride, col_stride = x.stride()
    if col_stride != 1 and k > 1:
        x = x.contiguous()
        row_stride = k
    if bias is not None:
        bias = bias.contiguous()
    out = x.new_empty((m, panels.n))
    if m == 0:
        return out
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    status = kernels.lib.wick_panel_gemm(
        x.data_ptr(),
        row_stride,
        panels.data.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        panels.n,
        k,
        torch.get_num_threads(),
        min_work_per_thread,
    )
    if status != 0:
        raise ValueError("the panel matmul is not in this build (no AVX512-BF16)")
    return out
