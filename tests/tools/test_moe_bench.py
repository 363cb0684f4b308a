"""`python -m tools.moe_bench` runs end to end on tiny experts (no timing is asserted)."""

from __future__ import annotations

import pytest

from tools import moe_bench


def test_one_line_per_token_count(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--experts", "4", "--hidden", "16", "--inter", "8", "--top-k", "2"]
    assert moe_bench.main([*argv, "--tokens", "1", "5", "--seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert "load average" in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [r[0] for r in rows] == ["1", "5"]
    assert all(r[-1].endswith("x") for r in rows)
