"""The interface every device platform implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Platform(ABC):
    name: str
    device_type: str
    dist_backend: str
    default_attention_backend: str
    supports_graphs: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]: ...

    @abstractmethod
    def default_dtype(self) -> torch.dtype: ...

    @abstractmethod
    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        """Bytes for the KV cache when the user gives no `--kv-cache-memory`."""

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed memory for the KV cache. It must be zeros, not garbage: slots past a sequence's
        length are masked out of the softmax, but NaN bits there would still poison probs @ V."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        return None

    def prepare(self, num_threads: int | None) -> None:
        """Process-wide setup before the model loads (threads, allocator settings)."""
        return None

    def resolve_dtype(self, name: str) -> torch.dtype:
        if name in ("auto", "", None):
            return self.default_dtype()
        aliases = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "float": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
            "half": torch.float16,
        }
        if name not in aliases:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
        dtype = aliases[name]
        if dtype not in self.supported_dtypes():
            raise ValueError(f"dtype {name} is not supported on {self.name}")
        return dtype
