"""NVIDIA CUDA platform: Triton attention, nccl collectives, bf16 by default."""

from __future__ import annotations

import torch

from model_server.platforms.interface import Platform, PlatformUnavailable


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_attention_backend = "triton"
    supports_graphs = True
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def check_available(cls) -> None:
        # torch.cuda.is_available() asks the driver (NVML) without creating a CUDA context.
        if not torch.cuda.is_available():
            raise PlatformUnavailable(
                "device cuda: no CUDA device is visible; install the NVIDIA driver and a CUDA "
                "build of torch (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu124), or check CUDA_VISIBLE_DEVICES"
            )

    def set_device(self, index: int) -> None:
        super().set_device(index)
        torch.cuda.set_device(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        # Replaced by profiling against gpu_memory_utilization in the model runner.
        free, _ = self.mem_get_info()
        return int(free * 0.8)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    @classmethod
    def compute_units(cls, device: torch.device) -> int | None:
        # A host-side driver query: no device sync.
        return torch.cuda.get_device_properties(device).multi_processor_count
