"""`bench structured` on the embedded SmolLM2: prints the compile line and, per batch size, the
free and constrained steps' masking figures (parsed, never timed)."""

from __future__ import annotations

import re

import pytest

from model_server.entrypoints.cli import main
from model_server.loader.embedded import embedded_model_available

pytestmark = pytest.mark.slow

LINE = re.compile(
    r"^batch (\d+), (free|constrained): step ([\d.]+) ms; masking ([\d.]+) ms "
    r"\(fill ([\d.]+) \+ apply ([\d.]+)\) = ([\d.]+)% of the step$",
    re.M,
)


def test_bench_structured_prints_masking_costs(capsys: pytest.CaptureFixture[str]) -> None:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 is not installed")
    argv = ["bench", "structured", "--batch-sizes", "1", "3", "--output-len", "4"]
    argv += ["--num-iters", "1", "--kv-cache-memory", "64MiB", "--max-model-len", "256"]
    argv += ["--dtype", "float32"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert re.search(r"^structured outputs: xgrammar \S+; cpu float32;", out, re.M), out
    assert re.search(r"^compile: 4 schemas, first [\d.]+ ms", out, re.M), out
    rows = {(int(m[0]), m[1]): [float(x) for x in m[2:]] for m in LINE.findall(out)}
    assert set(rows) == {(1, "free"), (1, "constrained"), (3, "free"), (3, "constrained")}, out
    for (_, kind), (step, mask, fill, apply, pct) in rows.items():
        assert step > 0 and abs(mask - (fill + apply)) < 2e-3
        if kind == "free":
            assert apply == 0.0  # no constrained row: the sampler never masks
        else:
            assert fill > 0 and apply > 0 and pct > 0


def test_bench_structured_checks_the_batch_fits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "structured", "--batch-sizes", "64", "--max-num-seqs", "8"])
    assert exit_info.value.code == 1
    assert "--max-num-seqs >= 64" in capsys.readouterr().err
