"""CPU platform: PyTorch's CPU kernels, gloo for collectives."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

from model_server.layers.linear import set_linear_impl
from model_server.layers.quantization import Int8Weight, set_int8_linear_impl
from model_server.platforms.interface import Platform

_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
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
    """
    if x.dim() != 2 or x.shape[0] not in _SKINNY_ROWS:
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


# Rows up to which PyTorch's int8 weight-only kernel (bf16 activations) beats the float matmul
# (measured on AVX2, 2 threads, SmolLM2's 576x1536 shapes: 1.6-3x faster at 1-8 rows, about even
# at 12, 1.2-1.6x slower from 16 rows on). More rows dequantize into a reused buffer instead.
_INT8_KERNEL_MAX_ROWS = 12


class _Int8Scratch:
    """One float buffer reused by every dequantizing matmul: a fresh multi-MB tensor per call
    would be mmap'ed and page-faulted in again each time (several times the matmul's cost)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def rows(self, weight: Int8Weight, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of the dequantized weight, in the buffer (until the next call)."""
        k = weight.shape[1]
        numel = (end - start) * k
        if self.buffer.dtype != dtype or self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=dtype)
        out = self.buffer[:numel].view(end - start, k)
        # A cast, then a multiply: both vectorized (one mixed int8 x float multiply is not).
        out.copy_(weight.qweight[start:end])
        return out.mul_(weight.scale[start:end, None].float())  # bf16 scales widen exactly


_int8_scratch = _Int8Scratch()


def _dequantized_linear(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequantized(weight)^T + bias, dequantizing one cache-sized block of rows at a time."""
    n, k = weight.shape
    block = max(1, _BLOCK_BYTES // (k * x.element_size()))
    if block >= n:
        return skinny_linear(x, _int8_scratch.rows(weight, 0, n, x.dtype), bias)
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    for start in range(0, n, block):
        end = min(n, start + block)
        out[:, start:end] = skinny_linear(x, _int8_scratch.rows(weight, start, end, x.dtype))
    if bias is not None:
        out += bias
    return out


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ dequantized(weight)^T + bias, in x's dtype (see layers/quantization.py).

    Few rows: `torch._weight_int8pack_mm` streams the int8 codes (1 byte per weight) with x
    rounded to bf16, accumulating in fp32, scaled by the (exact, bf16) per-row scales, and
    returns bf16. More rows: dequantize block by block, then the float matmul.
    """
    if x.shape[0] <= _INT8_KERNEL_MAX_ROWS:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), weight.qweight, weight.scale)
        out = out.to(x.dtype)
        if bias is not None:
            out += bias
        return out
    return _dequantized_linear(x, weight, bias)


# Replaces the flags read from /proc/cpuinfo (space-separated): runs the native-bf16 branches
# on a CPU without it (or the fp32 ones on a CPU with it), e.g. to test both on one machine.
CPU_FLAGS_ENV = "WICK_CPU_FLAGS"


def _cpu_flags() -> frozenset[str]:
    faked = os.environ.get(CPU_FLAGS_ENV)
    if faked is not None:
        return frozenset(faked.split())
    return _read_cpu_flags("/proc/cpuinfo")


@cache
def _read_cpu_flags(cpuinfo: str) -> frozenset[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend = "cpu"
    quantization_methods = ("int8",)
    shares_host_memory = True

    @classmethod
    def check_available(cls) -> None:
        return None  # always

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def mem_get_info(self) -> tuple[int, int]:
        pages = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * pages, os.sysconf("SC_PHYS_PAGES") * pages

    def default_dtype(self) -> torch.dtype:
        # Without native bf16 (avx512_bf16 / AMX) bf16 runs 3-10x slower than fp32 on CPUs.
        flags = _cpu_flags()
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        return _DEFAULT_KV_CACHE_BYTES

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # calloc (through numpy) hands out large blocks as fresh zero pages that are touched
        # lazily: no multi-GiB memset at start, and the resident size grows with blocks in use.
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

    def select_device(self, local_rank: int, device_ids: Sequence[int] | None) -> None:
        return None  # every rank computes on the host's cores (see prepare)

    def prepare(self, num_threads: int | None, local_world_size: int = 1) -> None:
        # Tensor-parallel ranks on one machine share its cores: each gets an equal part.
        threads = num_threads or max(1, len(os.sched_getaffinity(0)) // local_world_size)
        torch.set_num_threads(threads)
        set_linear_impl(skinny_linear)
        set_int8_linear_impl(int8_linear)
