"""`python -m tools.spec_decode_bench` runs end to end on the embedded model (no timing is
asserted; the editing workload's drafts are)."""

from __future__ import annotations

import pytest

from tools import spec_decode_bench

pytestmark = pytest.mark.slow


def test_both_workloads_report_and_match(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dtype", "float32", "--max-tokens", "24", "--runs", "1"]
    assert spec_decode_bench.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("load average before:")
    editing_on = next(line for line in lines if line.startswith("editing  spec on"))
    assert "draft tokens accepted" in editing_on
    assert "editing  speedup" in out and "chat     speedup" in out
    assert out.count("greedy output identical: True") == 2
