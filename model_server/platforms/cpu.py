"""CPU platform: PyTorch's CPU kernels (and kernels/cpu/ for matmuls), gloo for collectives."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from model_server.kernels.cpu.linear import int8_linear, skinny_linear
from model_server.kernels.table import KernelTable
from model_server.platforms.interface import Platform

_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# MKL-friendly matmuls for decode's few rows and PyTorch's int8 weight-only kernel
# (kernels/cpu/linear.py); norms and activations stay on the portable PyTorch ops.
_CPU_KERNELS = KernelTable(linear=skinny_linear, int8_linear=int8_linear)

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

    def kernel_table(self) -> KernelTable:
        return _CPU_KERNELS
