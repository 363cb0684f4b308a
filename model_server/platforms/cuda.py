"""NVIDIA CUDA platform: Triton attention, nccl collectives, bf16 by default."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from model_server.config import KernelOptions
from model_server.kernels.table import KernelTable, triton_kernels
from model_server.platforms.interface import Platform, PlatformUnavailable


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_attention_backend = "triton"
    supports_graphs = True
    quantization_methods = ("int8", "gptq", "awq")
    quantized_kv_cache_dtypes = ("int8", "fp8_e4m3", "fp8_e5m2")
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def check_available(cls) -> None:
        # torch.cuda.is_available() asks the driver (NVML) without creating a CUDA context.
        if not torch.cuda.is_available():
            raise PlatformUnavailable(
                "device cuda: no CUDA device is visible; install the NVIDIA driver and a CUDA "
                "build of torch (pip install torch, from PyTorch's CUDA wheel index for your "
                "driver), or check CUDA_VISIBLE_DEVICES"
            )

    def set_device(self, index: int) -> None:
        super().set_device(index)
        torch.cuda.set_device(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_stats_api(self) -> ModuleType:
        # Always complete: the KV cache is sized by profiling (engine/execution/memory_profiler.py).
        return torch.cuda

    def kernel_table(self, options: KernelOptions | None = None) -> KernelTable:
        # One-pass Triton RMSNorm (+ residual add) and SiluAndMul: at large decode batches the
        # PyTorch versions' ~8 kernels per call each move the whole activation. --quantization
        # int8: the w8a16 Triton kernel reads the int8 codes (kernels/int8_linear.py). Dense
        # matmuls stay on cuBLAS (F.linear).
        return triton_kernels()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def graph_capturer(self) -> CudaGraphCapturer:
        return CudaGraphCapturer(self.device)

    @classmethod
    def compute_units(cls, device: torch.device) -> int | None:
        # A host-side driver query: no device sync.
        return torch.cuda.get_device_properties(device).multi_processor_count


class CudaGraphCapturer:
    """torch.cuda graphs sharing one memory pool, captured on a side stream (a GraphCapturer, see
    platforms/interface.py)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = None
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output
