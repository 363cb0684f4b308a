"""`python -m tools.wna16_bench` runs end to end on a tiny model (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch

from tools import wna16_bench


def test_one_line_per_variant_and_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    argv = ["--rows", "1,70", "--layers", "2", "--hidden", "64", "--intermediate", "96"]
    argv += ["--heads", "4", "--kv-heads", "2", "--group-size", "32", "--rounds", "1"]
    try:
        assert wna16_bench.main([*argv, "--threads", "1", "--dtype", "fp32"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "ms/step" in line]
    # 1 row: torch, native float, w4 native, w4 dequantize; 70 rows: no native float.
    assert len(lines) == 7
    assert sum("w4 native" in line for line in lines) == 2
    assert out.count("w4 vs float:") == 2
