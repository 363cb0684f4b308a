"""CPU matmuls, float and int8 weight-only: the candidates that kernels/cpu/linear_tuning.py
times per (weight shape, row bucket) on the machine it runs on, and `skinny_linear` /
`int8_linear`, the fixed choices used when tuning is off (`WICK_CPU_LINEAR_TUNING=0`).

Every candidate follows F.linear's contract: x [M, K], weight [N, K], bias [N] | None -> a new
contiguous [M, N] in x's dtype; inputs are never written. The measurements behind the fixed
thresholds below are from MKL on AVX2 with 2 threads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts for which `W @ x^T` beats `x @ W^T` on MKL with weights streamed from memory
# (measured on AVX2, 2 threads, 30 SmolLM2 layers: 2-3x faster at 2-8 rows, ~1.3x at 16-64).
_SKINNY_ROWS = range(1, 65)
# Large matrices are multiplied (and int8 ones dequantized) in blocks of rows of about this many
# bytes, so a block is still in cache when it is used. At 8+ rows: SmolLM2's 113 MB LM head runs
# 1.1-1.5x faster than in one call (8-64 rows), a 4096x14336 layer 1.08x at 16-32 rows (1.12x
# slower at 4 rows, hence the 8). Dequantizing the LM head in one piece took 51 ms, 2 in blocks.
_BLOCK_BYTES = 4 << 20


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, computed differently for the few rows of a decode batch.

    MKL's sgemm picks a poor kernel for x [M, K] @ W^T at small M and a good one for
    W [N, K] @ x^T. At M = 1 its gemv runs on one thread (~15 GB/s of weights); splitting W's
    rows into one bmm batch per thread streams them at ~27 GB/s, near the memory bandwidth.

    fp32 only: these are workarounds for MKL's sgemm, and PyTorch hands other dtypes to
    oneDNN, where they cost instead (bf16 on a Zen 4, SmolLM2's shapes at 1 row: the bmm split
    69-120 us against F.linear's 47-86, 4.8 ms against 3.1 for the LM head).
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] not in _SKINNY_ROWS:
        return F.linear(x, weight, bias)
    n, k = weight.shape
    parts = torch.get_num_threads()
    if x.shape[0] == 1 and parts > 1 and n % parts == 0:
        # [parts, n / parts, k] @ [parts, k, 1] -> [n] as a [1, n] row.
        out = torch.bmm(weight.view(parts, n // parts, k), x.t().expand(parts, k, 1)).view(1, n)
    elif x.shape[0] >= 8 and n * k * weight.element_size() > 2 * _BLOCK_BYTES:
        block = max(1, _BLOCK_BYTES // (k * weight.element_size()))
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        for start in range(0, n, block):
            out[:, start : start + block] = torch.mm(weight[start : start + block], x.t()).t()
    else:
        out = torch.mm(weight, x.t()).t().contiguous()  # [M, N]
    if bias is not None:
        out += bias
    return out


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        out += bias
    return out


def mm_transposed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`W @ x^T`, transposed back: BLAS picks its kernel for a [N, K] x [K, M] product, which
    for few rows is often not the one it picks for x @ W^T."""
    return _add_bias(torch.mm(weight, x.t()).t().contiguous(), bias)


def bmm_row_split_applies(rows: int, weight: torch.Tensor) -> bool:
    """Whether `bmm_row_split` runs these inputs: one row, N divisible by the thread count."""
    parts = torch.get_num_threads()
    return rows == 1 and parts > 1 and weight.shape[0] % parts == 0


def bmm_row_split(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One row: W's rows split into one bmm batch per thread, so a gemv that BLAS would run on
    one thread streams the weight on all of them. Only where `bmm_row_split_applies`."""
    n, k = weight.shape
    parts = torch.get_num_threads()
    # [parts, n / parts, k] @ [parts, k, 1] -> [n] as a [1, n] row.
    out = torch.bmm(weight.view(parts, n // parts, k), x.t().expand(parts, k, 1)).view(1, n)
    return _add_bias(out, bias)


def row_blocks(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`W @ x^T` one cache-sized block of W's rows at a time (a large matrix and 8+ rows)."""
    n, k = weight.shape
    block = max(1, _BLOCK_BYTES // (k * weight.element_size()))
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    for start in range(0, n, block):
        out[:, start : start + block] = torch.mm(weight[start : start + block], x.t()).t()
    return _add_bias(out, bias)


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in oneDNN's blocked layout for this CPU (an opaque `torch._mkldnn` tensor
    of the same bytes), what inductor prepacks for CPU linears. Raises where torch's oneDNN has
    no kernel for the dtype (fp16 without avx512_fp16, a build without oneDNN)."""
    # The batch-size hint does not change the layout oneDNN picks (measured with torch 2.13).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def onednn_packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T + bias with W prepacked by `pack_onednn_weight` -> [M, N] in x's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Rows up to which PyTorch's int8 weight-only kernel (bf16 activations) beats the float matmul
# (measured on AVX2, 2 threads, SmolLM2's 576x1536 shapes: 1.6-3x faster at 1-8 rows, about even
# at 12, 1.2-1.6x slower from 16 rows on). More rows dequantize into a reused buffer instead.
_INT8_KERNEL_MAX_ROWS = 12


class _Int8Scratch:
    """One float buffer reused by every dequantizing matmul: a fresh multi-MB tensor per call
    would be mmap'ed and page-faulted in again each time (several times the matmul's cost).

    A per-process cache, not a setting: its content is only valid until the next call."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def rows(
        self, qweight: torch.Tensor, scale: torch.Tensor, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows [start, end) of the dequantized weight [N, K], in the buffer (until the next
        call)."""
        k = qweight.shape[1]
        numel = (end - start) * k
        if self.buffer.dtype != dtype or self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=dtype)
        out = self.buffer[:numel].view(end - start, k)
        # A cast, then a multiply: both vectorized (one mixed int8 x float multiply is not).
        out.copy_(qweight[start:end])
        return out.mul_(scale[start:end, None].float())  # bf16 scales widen exactly


_int8_scratch = _Int8Scratch()


def dequantized_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequantized(weight)^T + bias, dequantizing one cache-sized block of rows at a time."""
    n, k = qweight.shape
    block = max(1, _BLOCK_BYTES // (k * x.element_size()))
    if block >= n:
        return skinny_linear(x, _int8_scratch.rows(qweight, scale, 0, n, x.dtype), bias)
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    for start in range(0, n, block):
        end = min(n, start + block)
        out[:, start:end] = skinny_linear(
            x, _int8_scratch.rows(qweight, scale, start, end, x.dtype)
        )
    if bias is not None:
        out += bias
    return out


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight [N, K] int8, scale [N] bf16)^T + bias -> [M, N] in x's
    dtype (see layers/quantization/).

    Few rows: `torch._weight_int8pack_mm` streams the int8 codes (1 byte per weight) with x
    rounded to bf16, accumulating in fp32, scaled by the (exact, bf16) per-row scales, and
    returns bf16. More rows: dequantize block by block, then the float matmul.
    """
    if x.shape[0] <= _INT8_KERNEL_MAX_ROWS:
        return int8_kernel_linear(x, qweight, scale, bias)
    return dequantized_linear(x, qweight, scale, bias)


def int8_kernel_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`torch._weight_int8pack_mm`: streams the int8 codes with x rounded to bf16. Its CPU
    kernel (torch 2.13) segfaults for K not a multiple of 16 at more than one row (DeepSeek's
    tiny q_lora_rank 24): those dequantize instead."""
    if qweight.shape[1] % 16 and x.shape[0] > 1:
        return dequantized_linear(x, qweight, scale, bias)
    out = torch._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scale).to(x.dtype)
    return _add_bias(out, bias)
