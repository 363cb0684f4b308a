"""GGUF weights kept quantized on CPU: `KernelTable.gguf_linear` and `gguf_dequantize` on the
native kernels of gguf_gemm.c.

Few rows of x (decode steps): `wick_gguf_gemm` reads W in its packed size and decodes each row
once into L1 for all rows of x. Many rows (prefills): W is dequantized DEQUANT_CHUNK_ROWS rows
at a time (in x's dtype) and multiplied by PyTorch's GEMM, whose blocking beats a row-at-a-time
loop once the decoding is amortized over many rows of x; `GGUF_GEMM_MAX_ROWS` is where the
switch happens (measured: README's GGUF section). Inputs the kernel does not take (another
dtype or device, no native build) go to the portable dequantize-then-matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.gguf_blocks import dequantize_rows, gguf_linear_dequant

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Rows of x up to which the native kernel runs; above, dequantize-then-GEMM. Measured on a
# 2-core Zen 4 (one thread, SmolLM2's Q4_1 gate and down projections, a loaded machine): in
# fp32 the native kernel was ahead up to 32 rows and even at 64; in bf16 PyTorch's bf16 GEMM
# on the dequantized chunk won from 32 rows.
GGUF_GEMM_MAX_ROWS = {torch.float32: 48, torch.bfloat16: 16}
# Rows of W dequantized per GEMM in the many-rows path (a few MB of floats: cache-friendly,
# and never a whole float copy of a large matrix).
DEQUANT_CHUNK_ROWS = 512
# Multiply-adds worth another thread (as gemm.py's MIN_WORK_PER_THREAD).
MIN_WORK_PER_THREAD = 1 << 17


def gguf_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ W^T + bias with W the GGUF rows `blocks` [N, row_bytes], on the
    native kernel whatever M (tests and the tuner call it directly)."""
    kernels = kernels or default_kernels()
    code = _DTYPE_CODES.get(x.dtype)
    if kernels is None or code is None or not x.is_cpu:
        return gguf_linear_dequant(x, blocks, ggml_type, bias)
    m, k = x.shape
    n = blocks.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    blocks = blocks.contiguous()
    out = x.new_empty((m, n))
    # ctypes drops the GIL for the call, so the HTTP event loop keeps running meanwhile.
    status = kernels.lib.wick_gguf_gemm(
        ggml_type,
        code,
        x.data_ptr(),
        x.stride(0),
        blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
        MIN_WORK_PER_THREAD,
    )
    if status == -1:
        raise ValueError(f"gguf matmul: ggml type {ggml_type} with K={k} is not supported")
    if status != 0:
        raise MemoryError("the gguf matmul could not allocate its scratch rows")
    return out


def gguf_dequantize(
    blocks: torch.Tensor,
    ggml_type: int,
    k: int,
    dtype: torch.dtype = torch.float32,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """Rows blocks [R, row_bytes] -> [R, k] in `dtype` (fp32/bf16 natively, else portable)."""
    kernels = kernels or default_kernels()
    code = _DTYPE_CODES.get(dtype)
    if kernels is None or code is None or not blocks.is_cpu:
        return dequantize_rows(blocks, ggml_type, k, dtype)
    blocks = blocks.contiguous()
    out = torch.empty((blocks.shape[0], k), dtype=dtype)
    status = kernels.lib.wick_gguf_dequant(
        ggml_type, code, blocks.data_ptr(), blocks.shape[0], k, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"gguf dequantize: ggml type {ggml_type} with K={k} is not supported")
    return out


def dequant_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """The many-rows path: W dequantized DEQUANT_CHUNK_ROWS rows at a time, each chunk one
    PyTorch GEMM into its columns of the output."""
    m, k = x.shape
    n = blocks.shape[0]
    if n <= DEQUANT_CHUNK_ROWS:
        return F.linear(x, gguf_dequantize(blocks, ggml_type, k, x.dtype, kernels), bias)
    out = x.new_empty((m, n))
    for start in range(0, n, DEQUANT_CHUNK_ROWS):
        end = min(n, start + DEQUANT_CHUNK_ROWS)
        weight = gguf_dequantize(blocks[start:end], ggml_type, k, x.dtype, kernels)
        out[:, start:end] = F.linear(x, weight)
    if bias is not None:
        out += bias
    return out


def gguf_linear(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """The CPU `KernelTable.gguf_linear`: the native kernel for up to GGUF_GEMM_MAX_ROWS rows
    of x, dequantize-then-GEMM above."""
    if x.shape[0] <= GGUF_GEMM_MAX_ROWS.get(x.dtype, 0):
        return gguf_gemm(x, blocks, ggml_type, bias)
    if x.dtype not in _DTYPE_CODES or not x.is_cpu:
        return gguf_linear_dequant(x, blocks, ggml_type, bias)
    return dequant_gemm(x, blocks, ggml_type, bias)
