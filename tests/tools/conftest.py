"""The tools' tests import kernel modules (`tools.compile_check` runs in subprocesses of its own).

Like tests/kernels/conftest.py, TRITON_INTERPRET is set at conftest import when no CUDA GPU exists,
so that kernel modules imported in this process are decorated for the interpreter whatever order
the test folders are collected in.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
