"""Kernel tests run the Triton kernels on the CPU under the interpreter when no CUDA GPU exists.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is decorated), so it is set here, at conftest import, ahead of test module collection.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """Where a kernel test runs: CUDA when present (compiled kernels), else the CPU (the
    interpreter). Tests taking it are `gpu`-marked on CUDA machines (the root conftest.py)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
