"""`python -m tools.gguf_bench` runs end to end on a tiny model (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch

from tools import gguf_bench


def test_one_line_per_variant_and_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    argv = ["--rows", "1,5", "--layers", "2", "--hidden", "64", "--intermediate", "96"]
    argv += ["--heads", "4", "--kv-heads", "2", "--vocab", "40", "--rounds", "1"]
    try:
        assert gguf_bench.main([*argv, "--threads", "1", "--dtype", "fp32"]) == 0
        # Q3_K has no int8 path (the float kernel stands in); K-quants need K % 256 == 0
        argv[argv.index("--hidden") + 1] = "256"
        argv[argv.index("--intermediate") + 1] = "512"
        assert gguf_bench.main([*argv, "--type", "q3_k", "--head-type", "q6_k"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "ms/step" in line]
    assert len(lines) == 2 * 2 * 5  # two runs, two row counts, five variants
    assert out.count("kept tuned / dense tuned:") == 4
