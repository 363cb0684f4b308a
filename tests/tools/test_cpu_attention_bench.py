"""`python -m tools.cpu_attention_bench` runs end to end on tiny decodes (no timing is asserted)."""

from __future__ import annotations

import pytest
import torch

from tools import cpu_attention_bench


def test_one_line_per_dtype_batch_and_context(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        argv = ["--batch", "1", "3", "--ctx", "5", "--dtype", "bfloat16", "float32"]
        assert cpu_attention_bench.main([*argv, "--threads", "1", "--seconds", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "load average" in out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (dtype, batch, "5") for dtype in ("bfloat16", "float32") for batch in ("1", "3")
    ]
