"""The one place that reads Triton's version-dependent internals.

Triton moved its run-time switches into `triton.knobs` in 3.4 (before: environment variables read
where used, and helpers in `triton.backends.nvidia.compiler`). Kernel modules and tools ask here
instead of touching either spelling, so a Triton the kernels do not support fails with one clear
error rather than an `AttributeError` at the first launch.

MIN_TRITON is the oldest release the kernels and tools/compile_check are written for (knobs,
`GPUTarget`, the `JITFunction.run(..., warmup=)` launcher); pyproject.toml's `triton>=` bound and
docker/Dockerfile.cuda's base image agree with it (tests/kernels/test_triton_compat.py).
"""

from __future__ import annotations

import os
import re
from functools import cache
from types import ModuleType
from typing import Any

MIN_TRITON: tuple[int, int] = (3, 4)


class UnsupportedTriton(RuntimeError):
    """The installed Triton is older than MIN_TRITON."""


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0' or '3.4.0+git1234'."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return int(match[1]), int(match[2])


def _triton() -> ModuleType:
    import triton

    return triton


def triton_version() -> tuple[int, int]:
    return parse_version(_triton().__version__)


@cache
def require_supported_triton() -> tuple[int, int]:
    """The installed Triton's (major, minor); raises UnsupportedTriton when it is too old."""
    version = triton_version()
    if version < MIN_TRITON:
        raise UnsupportedTriton(
            f"Triton {_triton().__version__} is installed; Wick's kernels need Triton >= "
            f"{MIN_TRITON[0]}.{MIN_TRITON[1]} (torch >= 2.8 ships it)"
        )
    return version


def _knobs() -> Any | None:
    return getattr(_triton(), "knobs", None)


def interpreting() -> bool:
    """Whether `triton.jit` kernels run under the interpreter (TRITON_INTERPRET=1).

    Read where a kernel is launched, not cached: tests switch it per process before importing
    kernel modules.
    """
    knobs = _knobs()
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cuobjdump_path() -> str:
    """Triton's bundled cuobjdump (or the one TRITON_CUOBJDUMP_PATH names)."""
    knobs = _knobs()
    if knobs is not None:
        return str(knobs.nvidia.cuobjdump.path)
    from triton.backends.nvidia import compiler

    return str(compiler._path_to_binary("cuobjdump")[0])


def swap_active_driver(driver: Any) -> Any:
    """Make `driver` Triton's active one; returns what to pass to `restore_active_driver`.

    `triton.runtime.driver._active` is None until something asked for the driver; reading it
    directly avoids `reset_active()`, which needs a real GPU.
    """
    from triton.runtime import driver as config

    previous = config._active
    config.set_active(driver)
    return previous


def restore_active_driver(previous: Any) -> None:
    from triton.runtime import driver as config

    config._active = previous
