"""Device platforms: everything that differs between cpu, cuda, ... lives behind `Platform`.

Nothing outside this package branches on the device name.
"""

from __future__ import annotations

from model_server.platforms.interface import Platform


def get_platform(device: str = "cpu") -> Platform:
    """The platform for `device` (`auto` picks the best one present)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from model_server.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if device == "cuda":
        from model_server.platforms.cuda import CudaPlatform

        return CudaPlatform()
    raise ValueError(f"unsupported device {device!r}; choose one of: auto, cpu, cuda")


__all__ = ["Platform", "get_platform"]
