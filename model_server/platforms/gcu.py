"""Enflame GCU platform (S60 and later) through `torch_gcu`: eccl collectives, bf16 by default.

`torch_gcu` adds the `gcu` device type and the `torch.gcu` namespace (a torch.cuda look-alike)
and registers the `eccl` torch.distributed backend when imported. Attention runs on Triton only
where Enflame's Triton backend is installed, otherwise on the portable PyTorch backend. Matmuls,
`-q int8` and GPTQ / AWQ checkpoints (dense and MoE experts) run the portable PyTorch kernel
table: quantized weights are dequantized into the matmul's dtype (each group's scale and offset),
then one float matmul (kernels/portable.py).
The Triton int8 / wNa16 matmuls are not offered even with Enflame's Triton: only attention picks
Triton here, and those kernels are proven on CUDA alone.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache
from types import ModuleType

import torch

from model_server.platforms.interface import Platform, PlatformUnavailable

_INSTALL_HINT = (
    "install Enflame's TopsRider stack (the GCU driver on the host, then the torch_gcu and "
    "eccl packages, e.g. `TopsRider_i3x_*.run -C torch-gcu`), or check TOPS_VISIBLE_DEVICES"
)


def _torch_gcu() -> ModuleType:
    """The `torch.gcu` namespace (imports torch_gcu on first use)."""
    try:
        import torch_gcu  # noqa: F401 (registers the device, torch.gcu and eccl)
    except ImportError as exc:
        raise PlatformUnavailable(
            f"device gcu: the torch_gcu package is not installed ({exc}); {_INSTALL_HINT}"
        ) from None
    return torch.gcu  # type: ignore[attr-defined]


@cache
def enflame_triton_available() -> bool:
    """Whether Triton can compile for GCUs (Enflame's Triton backend is installed)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if importlib.util.find_spec("triton_gcu") is not None:
        return True
    try:
        backends = importlib.import_module("triton.backends").backends
    except (ImportError, AttributeError):
        return False
    return any(name in backends for name in ("gcu", "enflame"))


class GcuPlatform(Platform):
    name = "gcu"
    device_type = "gcu"
    dist_backend = "eccl"
    # The portable torch path's plain int8 ops; fp8 storage is unproven on this runtime.
    quantized_kv_cache_dtypes = ("int8",)
    # The portable table's dequantizing matmuls (int8_linear_dequant, wna16_linear_dequant).
    quantization_methods = ("int8", "gptq", "awq")
    visible_devices_env = "TOPS_VISIBLE_DEVICES"

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("torch_gcu") is None:
            raise PlatformUnavailable(
                f"device gcu: the torch_gcu package is not installed; {_INSTALL_HINT}"
            )
        if not _torch_gcu().is_available():
            raise PlatformUnavailable(f"device gcu: torch_gcu sees no GCU; {_INSTALL_HINT}")

    @property
    def default_attention_backend(self) -> str:  # type: ignore[override]
        return "triton" if enflame_triton_available() else "torch"

    def set_device(self, index: int) -> None:
        super().set_device(index)
        _torch_gcu().set_device(index)

    def device_count(self) -> int:
        return int(_torch_gcu().device_count())

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def mem_get_info(self) -> tuple[int, int]:
        gcu = _torch_gcu()
        if hasattr(gcu, "mem_get_info"):
            free, total = gcu.mem_get_info(self.device)
            return int(free), int(total)
        total = int(gcu.get_device_properties(self.device_index or 0).total_memory)
        return total - int(gcu.memory_reserved(self.device)), total

    def memory_stats_api(self) -> ModuleType | None:
        # torch.gcu mirrors torch.cuda's allocator statistics (can_profile_memory() checks).
        try:
            return _torch_gcu()
        except PlatformUnavailable:
            return None

    def synchronize(self) -> None:
        _torch_gcu().synchronize()

    def prepare(self, num_threads: int | None, local_world_size: int = 1) -> None:
        _torch_gcu()

    def init_distributed_backend(self) -> None:
        _torch_gcu()  # importing torch_gcu registers eccl
