"""Intel Gaudi (HPU) platform through `habana_frameworks.torch`: hccl collectives, bf16.

Gaudi runs in lazy mode by default (PT_HPU_LAZY_MODE=1): ops are recorded into a graph that
`htcore.mark_step()` compiles and runs, so every rank marks a step at the end of each model step.
Matmuls, `-q int8` and GPTQ / AWQ checkpoints (dense and MoE experts) run the portable PyTorch
kernel table: quantized weights are dequantized per group in the matmul's dtype
(kernels/portable.py).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from model_server.platforms.interface import Platform, PlatformUnavailable

_INSTALL_HINT = (
    "install the Intel Gaudi software stack (the habanalabs driver, then "
    "`pip install habana-torch-plugin` from Intel's Gaudi PyTorch packages), or check "
    "HABANA_VISIBLE_MODULES"
)


def _htcore() -> ModuleType:
    try:
        import habana_frameworks.torch.core as htcore
    except ImportError as exc:
        raise PlatformUnavailable(
            f"device hpu: habana_frameworks.torch is not installed ({exc}); {_INSTALL_HINT}"
        ) from None
    return htcore


def _hthpu() -> ModuleType:
    _htcore()
    import habana_frameworks.torch.hpu as hthpu

    return hthpu


class HpuPlatform(Platform):
    name = "hpu"
    device_type = "hpu"
    dist_backend = "hccl"
    # The portable torch path's plain int8 ops; fp8 storage is unproven on this runtime.
    quantized_kv_cache_dtypes = ("int8",)
    # The portable table's dequantizing matmuls (int8_linear_dequant, wna16_linear_dequant).
    quantization_methods = ("int8", "gptq", "awq")
    visible_devices_env = "HABANA_VISIBLE_MODULES"

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("habana_frameworks") is None:
            raise PlatformUnavailable(
                f"device hpu: habana_frameworks.torch is not installed; {_INSTALL_HINT}"
            )
        if not _hthpu().is_available():
            raise PlatformUnavailable(f"device hpu: no Gaudi device is visible; {_INSTALL_HINT}")

    def set_device(self, index: int) -> None:
        super().set_device(index)
        _hthpu().set_device(index)

    def device_count(self) -> int:
        return int(_hthpu().device_count())

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def mem_get_info(self) -> tuple[int, int]:
        hthpu = _hthpu()
        if hasattr(hthpu, "mem_get_info"):
            free, total = hthpu.mem_get_info()
            return int(free), int(total)
        stats = hthpu.memory_stats(self.device)
        total = int(stats.get("Limit", 0))
        return total - int(stats.get("InUse", 0)), total

    def memory_stats_api(self) -> ModuleType | None:
        # Recent Habana releases mirror torch.cuda's allocator statistics here; older ones lack
        # some (then can_profile_memory() is False and the default budget applies).
        try:
            return _hthpu()
        except (PlatformUnavailable, ImportError):
            return None

    def synchronize(self) -> None:
        _hthpu().synchronize()

    def mark_step(self) -> None:
        _htcore().mark_step()  # one dict lookup once imported

    def prepare(self, num_threads: int | None, local_world_size: int = 1) -> None:
        _htcore()

    def init_distributed_backend(self) -> None:
        import habana_frameworks.torch.distributed.hccl  # noqa: F401 (registers hccl)
