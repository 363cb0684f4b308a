"""CPU matmuls of wNa16 weights (GPTQ, AWQ kept quantized; the layout is kernels/portable.py's):
`wna16_native_linear` (kernels/cpu/wna16_gemm.c, dequantizing in registers: decode's few rows),
`wna16_dequantized_linear` (dequantize a cache-sized block of W's rows at a time, then the float
matmul: big prefills), and `wna16_linear`, the fixed choice between them used when the startup
timing (kernels/cpu/linear_tuning.py) is off or has not seen a shape.

Every function follows `KernelTable.wna16_linear`'s contract: x [M, K], codes, scales, offsets,
bits, group_size, bias [N] | None -> a new contiguous [M, N] in x's dtype.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear import _BLOCK_BYTES, skinny_linear
from model_server.kernels.portable import WNA16_BLOCK, dequantize_wna16

_ARGS = struct.Struct("=15q")
# Multiply-adds that justify one more thread (as gemm.py's, for the same reasons).
MIN_WORK_PER_THREAD = 1 << 17
# Rows up to which the fixed choice runs the native kernel: it streams W once for all rows, but
# its dequantizing FMAs are paid per tile of x rows; from a few dozen rows a float GEMM on a
# dequantized block wins (the tuner measures where).
NATIVE_MAX_ROWS = 32


def wna16_applies(codes: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """Whether the native kernel can run this weight (layout, a built library)."""
    if not codes.is_cpu or not codes.is_contiguous() or bits not in (4, 8):
        return False
    if group_size % WNA16_BLOCK or k % WNA16_BLOCK:
        return False
    return default_kernels() is not None


def wna16_native_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    kernels: native.NativeKernels | None = None,
    min_work_per_thread: int = MIN_WORK_PER_THREAD,
) -> torch.Tensor:
    """The native kernel (x fp32 or bf16); other inputs go to `wna16_dequantized_linear`."""
    m, k = x.shape
    n = codes.shape[0]
    code = native.DTYPE_CODES.get(x.dtype)
    kernels = kernels or default_kernels()
    if (
        code is None
        or kernels is None
        or not x.is_cpu
        or not wna16_applies(codes, bits, group_size, k)
        or codes.shape[1] * 8 // bits != k
        or scales.dtype != torch.float32
        or offsets.dtype != torch.float32
        or not (scales.is_contiguous() and offsets.is_contiguous())
        or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
    ):
        return wna16_dequantized_linear(x, codes, scales, offsets, bits, group_size, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = x.new_empty((m, n))
    status = kernels.lib.wick_wna16_gemm_packed(
        _ARGS.pack(
            code,
            x.data_ptr(),
            x.stride(0),
            codes.data_ptr(),
            scales.data_ptr(),
            offsets.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            bits,
            group_size,
            torch.get_num_threads(),
            min_work_per_thread,
        )
    )
    if status == -2:
        raise ValueError(
            f"wna16 matmul: unsupported layout (bits {bits}, group {group_size}, K {k})"
        )
    if status != 0:
        raise MemoryError("the native wna16 matmul could not allocate its scratch buffer")
    return out


class _Scratch:
    """One buffer reused by every dequantizing matmul (as kernels/cpu/linear.py's int8 one: a
    fresh multi-MB tensor per call would be page-faulted in again each time). Per process; its
    content is valid until the next call."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def rows(self, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        if self.buffer.dtype != dtype or self.buffer.numel() < n * k:
            self.buffer = torch.empty(n * k, dtype=dtype)
        return self.buffer[: n * k].view(n, k)


_scratch = _Scratch()


def wna16_dequantized_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize W one cache-sized block of rows at a time (in x's dtype; natively where the
    library runs the layout, into a reused buffer), each multiplied while it is in cache."""
    n = codes.shape[0]
    k = x.shape[1]
    block = max(1, _BLOCK_BYTES // (k * x.element_size()))

    kernels = default_kernels()
    native_ok = (
        kernels is not None
        and x.dtype in native.DTYPE_CODES
        and codes.is_cpu
        and codes.is_contiguous()
        and scales.dtype == offsets.dtype == torch.float32
        and scales.is_contiguous()
        and offsets.is_contiguous()
        and wna16_applies(codes, bits, group_size, k)
    )

    def rows(start: int, end: int) -> torch.Tensor:
        if not native_ok:
            return dequantize_wna16(
                codes[start:end], scales[start:end], offsets[start:end], bits, group_size, x.dtype
            )
        assert kernels is not None
        w = _scratch.rows(end - start, k, x.dtype)
        status = kernels.lib.wick_wna16_dequantize(
            native.DTYPE_CODES[x.dtype],
            codes[start].data_ptr(),
            scales[start].data_ptr(),
            offsets[start].data_ptr(),
            w.data_ptr(),
            end - start,
            k,
            bits,
            group_size,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"wna16 dequantize: unsupported layout (bits {bits}, K {k})")
        return w

    if block >= n:
        return skinny_linear(x, rows(0, n), bias)
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    for start in range(0, n, block):
        end = min(n, start + block)
        out[:, start:end] = F.linear(x, rows(start, end))
    if bias is not None:
        out += bias
    return out


def wna16_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fixed choice: the native kernel up to NATIVE_MAX_ROWS rows, else dequantize-then-
    matmul."""
    if x.shape[0] <= NATIVE_MAX_ROWS:
        return wna16_native_linear(x, codes, scales, offsets, bits, group_size, bias)
    return wna16_dequantized_linear(x, codes, scales, offsets, bits, group_size, bias)
