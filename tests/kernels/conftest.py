"""Kernel tests run the Triton kernels on the CPU under the interpreter when no CUDA GPU exists.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is decorated), so it is set here, at conftest import, ahead of test module collection.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where a kernel test runs: CUDA when present (compiled kernels), else the CPU (the
    interpreter). Tests taking it are `gpu`-marked on CUDA machines (the root conftest.py)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the TP cases of tests/kernels, holding this process's build of the kernels: the
    spawned rank finds it there instead of compiling its own (minutes on a loaded machine)."""
    cache = tmp_path_factory.mktemp("tp-cache")
    from model_server.kernels.cpu.gemm import default_kernels

    kernels = default_kernels()
    assert kernels is not None
    built = Path(kernels.lib._name)
    (cache / "kernels").mkdir()
    shutil.copy2(built, cache / "kernels" / built.name)
    return cache
