"""`python -m tools.cpu_linear_bench` runs end to end on a tiny shape (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch

from tools import cpu_linear_bench


def test_one_line_per_shape_dtype_and_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        argv = ["--shapes", "40x24", "--rows", "1,3", "--dtypes", "bf16,fp32", "--threads", "1"]
        assert cpu_linear_bench.main([*argv, "--footprint-mb", "1", "--seconds", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [line for line in capsys.readouterr().out.splitlines() if "M=" in line]
    assert len(lines) == 4
    assert all("F.linear" in line and "native_gemm" in line for line in lines)
    assert all("native_shift" in line for line in lines if "bfloat16" in line)
