"""NVIDIA CUDA platform: Triton attention, nccl collectives, bf16 by default."""

from __future__ import annotations

import torch

from model_server.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_attention_backend = "triton"
    supports_graphs = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "LLM_DEVICE=cuda but no CUDA device is visible: install the NVIDIA driver and a "
                "CUDA build of torch, or check CUDA_VISIBLE_DEVICES"
            )

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        # Replaced by profiling against gpu_memory_utilization in the model runner.
        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.8)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
