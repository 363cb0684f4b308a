"""CPU platform: PyTorch's CPU kernels, gloo for collectives."""

from __future__ import annotations

import os
from functools import cache

import torch

from model_server.platforms.interface import Platform

_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
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
    default_attention_backend = "torch"
    # Large CPU allocations are fresh anonymous mmaps: already zero, and touched lazily, so the
    # resident size grows with the blocks in use instead of paying a multi-GiB memset at start.
    zero_init_kv_cache = False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def default_dtype(self) -> torch.dtype:
        # Without native bf16 (avx512_bf16 / AMX) bf16 runs 3-10x slower than fp32 on CPUs.
        flags = _cpu_flags()
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        return _DEFAULT_KV_CACHE_BYTES

    def prepare(self, num_threads: int | None) -> None:
        threads = num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
