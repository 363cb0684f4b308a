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


def test_wna16_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--experts", "4", "--hidden", "64", "--inter", "32", "--top-k", "2", "--wna16", "4"]
    assert (
        moe_bench.main([*argv, "--group-size", "32", "--tokens", "1", "3", "--seconds", "0"]) == 0
    )
    out = capsys.readouterr().out
    # 4 experts x 3 matrices of 64 x 32: 96 KiB in fp32 against 12 KiB of codes + 6 of scales.
    assert "weights 0.1 MiB float32 against 0.0 MiB w4 g32" in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [r[0] for r in rows] == ["1", "3"] and all(r[-1].endswith("x") for r in rows)
