"""Device platforms: everything that differs between cpu, cuda, gcu and hpu lives behind
`Platform`. Nothing outside this package branches on the device name.

Platform modules import their vendor runtime lazily, so this package imports on any machine.
"""

from __future__ import annotations

import importlib

from model_server.platforms.interface import Platform, PlatformUnavailable

# name -> (module under model_server.platforms, class name)
_PLATFORMS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu", "CpuPlatform"),
    "cuda": ("cuda", "CudaPlatform"),
    "gcu": ("gcu", "GcuPlatform"),
    "hpu": ("hpu", "HpuPlatform"),
}
# What `auto` tries, best first; cpu is the fallback.
AUTO_ORDER: tuple[str, ...] = ("cuda", "hpu", "gcu")
DEVICES: tuple[str, ...] = ("auto", *_PLATFORMS)


def platform_class(device: str) -> type[Platform]:
    if device not in _PLATFORMS:
        raise ValueError(f"unsupported device {device!r}; choose one of: {', '.join(DEVICES)}")
    module_name, class_name = _PLATFORMS[device]
    module = importlib.import_module(f"model_server.platforms.{module_name}")
    return getattr(module, class_name)


def resolve_device(device: str) -> str:
    """`auto` -> the best device present (cuda > hpu > gcu > cpu); other names unchanged."""
    if device != "auto":
        return device
    for name in AUTO_ORDER:
        if platform_class(name).is_available():
            return name
    return "cpu"


def get_platform(device: str = "cpu") -> Platform:
    """The platform for `device`. Raises PlatformUnavailable (a ValueError naming what to
    install) when its runtime or devices are missing, ValueError for an unknown name."""
    cls = platform_class(resolve_device(device.strip().lower()))
    cls.check_available()
    return cls()


__all__ = [
    "AUTO_ORDER",
    "DEVICES",
    "Platform",
    "PlatformUnavailable",
    "get_platform",
    "platform_class",
    "resolve_device",
]
