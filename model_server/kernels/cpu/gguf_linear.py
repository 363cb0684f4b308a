"""GGUF weights kept quantized on CPU: `KernelTable.gguf_linear` and `gguf_dequantize` on the
native kernels of gguf_gemm.c and gguf_q8.c.

Three ways to multiply: `gguf_q8_gemm` (x rounded to int8 per 32 values, integer dot products
with W's codes: the fewest instructions per weight, for the types in Q8_TYPES); `gguf_gemm`
(codes widened to fp32: the dequantized model's products exactly, every type); and
`dequant_gemm` (W dequantized DEQUANT_CHUNK_ROWS rows at a time, then PyTorch's GEMM, whose
blocking wins once the decoding is amortized over many rows of x). The startup tuner
(linear_tuning.py, `CpuGGUFLinear`) times them per shape and row bucket; `gguf_linear` is the
fixed choice for untuned shapes and tuning off (Q8_MAX_ROWS, GGUF_GEMM_MAX_ROWS). Inputs the
kernels do not take (another dtype or device, no native build) go to the portable
dequantize-then-matmul.

`--gguf-int8-dot` (`WICK_GGUF_INT8_DOT`, INT8_DOT_ENV; the platform passes it as `int8_dot`)
says whether the int8 kernel may run: `auto` (default:
where it times fastest), `off` (never: the products of the dequantized model, at some speed)
or `on` (always, for the types it takes, untimed: tests pin the numerics with it).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

from model_server.kernels.cpu import native
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.gguf_blocks import dequantize_rows, gguf_linear_dequant
from model_server.kernels.table import GGUFLinearFn
from model_server.settings_spec import GGUF_INT8_DOT_MODES, resolve_setting

logger = logging.getLogger(__name__)

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
# ggml types the int8 dot-product kernel takes (gguf_q8.c: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K
# Q6_K); Q2_K, Q3_K and float segments run the float kernel.
Q8_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
# Rows of x up to which the fixed choice runs the int8 kernel (types in Q8_TYPES, mode auto).
# Measured (tools/gguf_bench.py, 2-core Zen 4, SmolLM2's Q4_1 step): ahead of the float kernel
# at 1 to 64 rows in fp32 and bf16 (1.1-1.65x), even with dequantize-then-GEMM at 64 in bf16.
Q8_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 64}
INT8_DOT_ENV = "WICK_GGUF_INT8_DOT"
INT8_DOT_MODES = GGUF_INT8_DOT_MODES


def int8_dot_mode() -> str:
    """`WICK_GGUF_INT8_DOT` (auto | on | off; 1/0, true/false too) as the settings read it, auto
    when unset; an unknown value is a ValueError naming it. For callers given no KernelOptions."""
    return resolve_setting("gguf_int8_dot")


def _native_gemm(
    entry_name: str,
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    kernels: native.NativeKernels | None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ W^T + bias on the native entry point `entry_name` (the
    arguments of wick_gguf_gemm); the portable dequantize-then-matmul where it cannot run."""
    kernels = kernels or default_kernels()
    code = native.DTYPE_CODES.get(x.dtype)
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
    status = getattr(kernels.lib, entry_name)(
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


def gguf_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) @ W^T + bias with W the GGUF rows `blocks` [N, row_bytes], on the
    native float kernel (gguf_gemm.c: codes widened to fp32) whatever M (tests and the tuner
    call it directly)."""
    return _native_gemm("wick_gguf_gemm", x, blocks, ggml_type, bias, kernels)


def q8_supports(ggml_type: int) -> bool:
    """Whether the int8 dot-product kernel (gguf_q8.c) takes this ggml type."""
    return ggml_type in Q8_TYPES


def gguf_q8_gemm(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """As `gguf_gemm` on the int8 dot-product kernel (gguf_q8.c): x rounded to int8 per block of
    32 values (one scale each), integer products with W's codes. Raises ValueError for the
    types it does not take (`q8_supports`)."""
    if not q8_supports(ggml_type):
        raise ValueError(f"gguf int8 matmul: ggml type {ggml_type} is not supported")
    return _native_gemm("wick_gguf_q8_gemm", x, blocks, ggml_type, bias, kernels)


def quantize_activations(
    x: torch.Tensor, kernels: native.NativeKernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's rounding of x [M, K] (K a multiple of 32): codes [M, K] int8 and
    scales [M, K / 32] fp32 with x ~ codes * scales per block (tests)."""
    kernels = kernels or default_kernels()
    if kernels is None:
        raise RuntimeError("the native CPU kernels are not available")
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((m, k), dtype=torch.int8)
    scales = torch.empty((m, k // 32), dtype=torch.float32)
    status = kernels.lib.wick_gguf_q8_quantize(
        native.DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), m, k, codes.data_ptr(),
        scales.data_ptr(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"gguf int8 activations: K={k} is not a multiple of 32")
    return codes, scales


def gguf_dequantize(
    blocks: torch.Tensor,
    ggml_type: int,
    k: int,
    dtype: torch.dtype = torch.float32,
    kernels: native.NativeKernels | None = None,
) -> torch.Tensor:
    """Rows blocks [R, row_bytes] -> [R, k] in `dtype` (fp32/bf16 natively, else portable)."""
    kernels = kernels or default_kernels()
    code = native.DTYPE_CODES.get(dtype)
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
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None,
    int8_dot: str = "auto",
) -> torch.Tensor:
    """The fixed CPU `KernelTable.gguf_linear` (tuning off, untuned shapes): the int8 kernel
    for up to Q8_MAX_ROWS rows of x (its types, `int8_dot` auto; always with on, never with
    off), else the float kernel up to GGUF_GEMM_MAX_ROWS rows, dequantize-then-GEMM above."""
    rows = x.shape[0]
    q8 = int8_dot != "off" and ggml_type in Q8_TYPES and x.dtype in native.DTYPE_CODES
    if q8 and (int8_dot == "on" or rows <= Q8_MAX_ROWS[x.dtype]):
        return gguf_q8_gemm(x, blocks, ggml_type, bias)
    if rows <= GGUF_GEMM_MAX_ROWS.get(x.dtype, 0):
        return gguf_gemm(x, blocks, ggml_type, bias)
    if x.dtype not in native.DTYPE_CODES or not x.is_cpu:
        return gguf_linear_dequant(x, blocks, ggml_type, bias)
    return dequant_gemm(x, blocks, ggml_type, bias)


def fixed_gguf_linear(int8_dot: str) -> GGUFLinearFn:
    """`gguf_linear` with the int8 mode read at table construction (not once per call)."""
    return gguf_linear if int8_dot == "auto" else partial(gguf_linear, int8_dot=int8_dot)
