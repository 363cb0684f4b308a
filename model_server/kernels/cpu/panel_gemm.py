"""The matmuls on panel-packed weights: a candidate of the CPU linear tuner
(kernels/cpu/linear_tuning.py) at every row count.

`pack_panels(weight)` re-lays a weight [N, K] out once, in one of two layouts (the same values,
rounded up to whole panels): bf16 weights on builds with AVX512-BF16 take the k-pair panels that
vdpbf16ps reads (kernels/cpu/panel_gemm.c); fp32 weights, and bf16 ones elsewhere, take panels of
one vector of outputs per k, multiplied in fp32 (kernels/cpu/panel_gemm_f32.c).
`panel_linear(x, panels, bias)` is F.linear's contract on them: x [M, K] @ W^T + bias -> a new
[M, N] in the weight's dtype (x and bias of that dtype), fp32 accumulation, inputs never written.
The pair layout's kernel prefetches each panel stream in software, or (`prefetch=False`,
`panel_linear_hwpf`) leaves it to the hardware prefetcher: the same bits, and which is faster
depends on the CPU, the shape and the rows, so the linear tuner times both (PREFETCH_PAIRS in
panel_gemm.c).

Both layouts' kernels are row-invariant: an output row is the same bits whatever the rows of
the call (each output sums K in one order in every register tile), which speculative
verification relies on (engine/spec_decode/row_invariance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD, default_kernels

PANEL = 16  # outputs per panel of the pair layout (panel_gemm.c)


@dataclass(slots=True, frozen=True)
class Panels:
    """A weight [n, k] in a panel layout: `data` holds its values in `dtype`."""

    data: torch.Tensor  # 1-D
    n: int
    k: int
    pairs: bool  # the vdpbf16ps layout (panel_gemm.c), else lanes (panel_gemm_f32.c)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def pairs_available(kernels: native.NativeKernels | None = None) -> bool:
    """Whether this CPU's build has the bf16 pair kernel (AVX512-BF16); builds the library on
    first call."""
    kernels = kernels or default_kernels()
    return kernels is not None and bool(kernels.lib.wick_panel_gemm_available())


def pack_panels(weight: torch.Tensor, kernels: native.NativeKernels | None = None) -> Panels:
    """weight [N, K] fp32 or bf16 -> its panels. Raises ValueError where no kernel can run it
    (another dtype, not a CPU matrix, no native build)."""
    kernels = kernels or default_kernels()
    if kernels is None:
        raise ValueError("the panel matmul needs the native kernels")
    code = native.DTYPE_CODES.get(weight.dtype)
    if code is None or weight.dim() != 2 or not weight.is_cpu:
        raise ValueError(
            f"the panel matmul takes a 2-D fp32 or bf16 CPU weight, not {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    weight = weight.detach().contiguous()
    n, k = weight.shape
    lib = kernels.lib
    pairs = weight.dtype == torch.bfloat16 and bool(lib.wick_panel_gemm_available())
    if pairs:
        data = torch.empty(lib.wick_panel_elements(n, k), dtype=weight.dtype)
        lib.wick_panel_pack(weight.data_ptr(), n, k, data.data_ptr())
    else:
        data = torch.empty(lib.wick_panel_f32_elements(n, k), dtype=weight.dtype)
        lib.wick_panel_f32_pack(code, weight.data_ptr(), n, k, data.data_ptr())
    return Panels(data, int(n), int(k), pairs)


def panel_linear(
    x: torch.Tensor,
    panels: Panels,
    bias: torch.Tensor | None = None,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
    prefetch: bool = True,
) -> torch.Tensor:
    """x [..., K] @ W^T + bias [N] -> [..., N], all in the panels' dtype, W given by its panels;
    on up to torch's thread count (fewer for small matmuls; 0 `min_work_per_thread`: all).
    `prefetch` False: the pair layout's kernel without software prefetch (ValueError on the
    lanes layout, which has no such variant)."""
    if not prefetch and not panels.pairs:
        raise ValueError("the lanes layout's panel matmul has no variant without prefetch")
    if x.dim() != 2:
        out = panel_linear(
            x.reshape(-1, x.shape[-1]), panels, bias, kernels, min_work_per_thread, prefetch
        )
        return out.view(*x.shape[:-1], panels.n)
    m, k = x.shape
    dtype = panels.dtype
    if x.dtype != dtype or k != panels.k or not x.is_cpu:
        raise ValueError(
            f"panel matmul: x must be {dtype} [M, {panels.k}] on the CPU, not {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if bias is not None and (bias.dtype != dtype or bias.shape != (panels.n,)):
        raise ValueError(f"panel matmul: bias must be {dtype} [{panels.n}]")
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
    bias_ptr = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    if panels.pairs:
        status = kernels.lib.wick_panel_gemm(
            x.data_ptr(), row_stride, panels.data.data_ptr(), bias_ptr, out.data_ptr(),
            m, panels.n, k, threads, min_work_per_thread, int(prefetch),
        )  # fmt: skip
    else:
        status = kernels.lib.wick_panel_f32_gemm(
            native.DTYPE_CODES[dtype], x.data_ptr(), row_stride, panels.data.data_ptr(), bias_ptr,
            out.data_ptr(), m, panels.n, k, threads, min_work_per_thread,
        )  # fmt: skip
    _check(status)
    return out


def panel_linear_hwpf(
    x: torch.Tensor,
    panels: Panels,
    bias: torch.Tensor | None = None,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
) -> torch.Tensor:
    """`panel_linear` without software prefetch (the pair layout only): the same bits."""
    return panel_linear(x, panels, bias, kernels, min_work_per_thread, prefetch=False)


def _check(status: int) -> None:
    """A panel kernel's return code as an exception (0: fine)."""
    if status == -2:
        raise ValueError("the panel matmul's pair layout is not in this build (no AVX512-BF16)")
    if status != 0:
        raise MemoryError("the panel matmul could not allocate its scratch buffer")


def silu_and_mul_applies(panels: Panels, kernels: native.NativeKernels | None = None) -> bool:
    """Whether `panel_silu_and_mul` runs on these panels: a merged gate/up weight [2 inter, K]
    whose halves start on a panel boundary (16 outputs in the pair layout, the build's vector
    width in the lanes layout)."""
    kernels = kernels or default_kernels()
    if kernels is None:
        return False
    unit = PANEL if panels.pairs else int(kernels.lib.wick_panel_f32_lanes())
    return panels.n % (2 * unit) == 0


def panel_silu_and_mul(
    x: torch.Tensor,
    panels: Panels,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
    prefetch: bool = True,
) -> torch.Tensor:
    """x [M, K] in the panels' dtype, the panels of a merged gate/up weight [2 inter, K] (no
    bias) -> a new [M, inter] = silu(x @ gate^T) * (x @ up^T): `silu_and_mul(panel_linear(x,
    panels))` bit for bit (layer_ops.c's SiLU), in one pass without the [M, 2 inter]
    intermediate. `prefetch`: as panel_linear's (the pair layout alone reads it)."""
    kernels = kernels or default_kernels()
    if kernels is None:
        raise ValueError("the panel matmul needs the native kernels")
    if not silu_and_mul_applies(panels, kernels):
        raise ValueError(
            f"fused SiLU: the gate and up halves of {panels.n} outputs do not start on a panel "
            "boundary"
        )
    dtype = panels.dtype
    if x.dim() != 2 or x.dtype != dtype or x.shape[1] != panels.k or not x.is_cpu:
        raise ValueError(
            f"fused SiLU: x must be {dtype} [M, {panels.k}] on the CPU, not {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    m, inter = x.shape[0], panels.n // 2
    out = x.new_empty((m, inter))
    if m == 0:
        return out
    threads = torch.get_num_threads()
    if panels.pairs:
        status = kernels.lib.wick_panel_gemm_silu(
            x.data_ptr(), x.stride(0), panels.data.data_ptr(), out.data_ptr(), m, inter,
            panels.k, threads, min_work_per_thread, int(prefetch),
        )  # fmt: skip
    else:
        status = kernels.lib.wick_panel_f32_gemm_silu(
            native.DTYPE_CODES[dtype], x.data_ptr(), x.stride(0), panels.data.data_ptr(),
            out.data_ptr(), m, inter, panels.k, threads, min_work_per_thread,
        )  # fmt: skip
    _check(status)
    return out
