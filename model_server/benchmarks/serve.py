"""`bench serve`: drive any OpenAI-compatible server with streaming requests and report latency
and throughput like vLLM's serving benchmark (`vllm bench serve`).

Random prompts (see `random_prompts`), one streaming completion per prompt, sent all at once
(bounded by `--max-concurrency`) or as a Poisson process at `--request-rate` requests/s. An
initial single request checks the endpoint first (and waits up to `--ready-check-timeout-sec`
for a server that is still starting); it is not counted. The same command measures Wick, vLLM
or llama.cpp's server, so their figures can be compared side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from model_server.benchmarks.openai_stream import (
    RequestResult,
    build_payload,
    is_chat_endpoint,
    stream_request,
)
from model_server.benchmarks.random_prompts import SampleRequest

if TYPE_CHECKING:
    import httpx


# vLLM's benchmark backends that speak the OpenAI completions API as Wick serves it.
BACKENDS = ("vllm", "openai")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8008", help="Server root URL (no /v1)."
    )
    parser.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="API path: /v1/completions, or /v1/chat/completions (prompt sent as a user message).",
    )
    parser.add_argument(
        "--model", default=None, help="Model name to request (None: the server's first model)."
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer for random prompts: a .gguf file, an HF folder or hub id, or 'none' for "
        "random words (None: the served model's, when --model or the `root` that /v1/models "
        "lists is a folder or file on this machine; else the embedded SmolLM2's when "
        "installed, else none).",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        help="LoRA adapter names the server serves (vLLM's flag): request i asks for name "
        "i mod N, so the adapters are mixed evenly (vLLM picks one at random per request).",
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="Number of requests.")
    parser.add_argument("--random-input-len", type=int, default=128, help="Prompt tokens.")
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens.")
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are uniform in [len·(1-r), len·(1+r)].",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Most requests in flight at once (None: no limit).",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals (inf: all at once).",
    )
    parser.add_argument(
        "--ignore-eos",
        "--ignore_eos",  # vLLM-GCU's benchmark_serving line spells it so
        action="store_true",
        help="Send vLLM's ignore_eos (full output lengths).",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature.")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of prompts and arrival times. The same seed sends the same prompts, which a "
        "server with a prefix cache answers from it in a later run: give each run its own.",
    )
    parser.add_argument(
        "--metric-percentiles",
        default="99",
        help="Comma-separated percentiles to report (e.g. 50,90,99).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="Bearer token (None: $OPENAI_API_KEY if set).",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=3600.0, help="Seconds before a request fails."
    )
    parser.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=60.0,
        help="How long the initial test request may retry while the server starts; 0 skips it.",
    )
    parser.add_argument("--save-result", default=None, help="Write all figures to this JSON file.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    g = parser.add_argument_group("vLLM-GCU's benchmark_serving flags")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="vllm",
        help="The server's API: vllm and openai are both /v1/completions (--endpoint picks "
        "another path); other backends of vLLM's benchmark are not supported.",
    )
    g.add_argument(
        "--dataset-name",
        choices=("random", "editing", "rag", "chat"),
        default="random",
        help="Prompts: random (--random-input-len tokens each), or answers that copy from their "
        "prompt: editing (rewrite a passage with one word changed: nearly all copy), rag (a "
        "question over three passages: some), chat (a plain question: none); those ask for "
        "--random-output-len tokens each (benchmarks/copy_workloads.py) and report the share "
        "of the answers' word trigrams found in their prompt.",
    )
    g.add_argument(
        "--strict-in-out-len",
        action="store_true",
        help="Exact lengths: --ignore-eos and min_tokens = max_tokens (every output is "
        "--random-output-len tokens), --random-range-ratio 0.",
    )
    g.add_argument(
        "--keep-special-tokens",
        action="store_true",
        help="Send skip_special_tokens false: special tokens stay in the output text.",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Accepted and ignored: tokenizers load without running a checkpoint's code.",
    )


def default_tokenizer(args: argparse.Namespace, served_root: str | None = None) -> str | None:
    """`--tokenizer`, else `--model` when it is a local folder or file (vLLM's benchmark takes
    the model's tokenizer so; a served name is no path), else the served model's `root` (from
    /v1/models: the server's --model) when it is one, else None (load_tokenizer's default)."""
    if args.tokenizer is not None:
        return args.tokenizer
    for name in (args.model, served_root):
        path = _local_model_path(name)
        if path is not None:
            return path
    return None


def _local_model_path(name: str | None) -> str | None:
    """`name` when it is a folder or file this machine has (a hub id or served name is not)."""
    if not name:
        return None
    path = os.path.expanduser(name)
    return path if os.path.exists(path) else None


def served_model_root(args: argparse.Namespace) -> str | None:
    """The `root` (else `id`) of the served model (`--model`'s card, else the first) in the
    server's /v1/models; None when the server lists no such card. Waits for a starting server
    as the benchmark's own model lookup does; without --model a server that cannot list its
    models is the benchmark's error, with it None (the run names its model itself)."""
    import httpx

    async def ask() -> str | None:
        base_url = args.base_url.rstrip("/")
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        deadline = time.monotonic() + max(0.0, args.ready_check_timeout_sec)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False) as client:
            while True:
                try:
                    cards = await served_models(client, base_url, headers)
                    break
                except ServerNotReady:
                    if args.model is not None:
                        return None
                    if time.monotonic() >= deadline:
                        raise
                except RuntimeError:
                    if args.model is not None:
                        return None
                    raise
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if args.model is None:
            card = cards[0]
        else:
            card = next((c for c in cards if c["id"] == args.model), None)
            if card is None:
                return None
        root = card.get("root") or card.get("id")
        return str(root) if root else None

    return asyncio.run(ask())


def extra_fields(args: argparse.Namespace, output_len: int) -> dict[str, Any]:
    """vLLM's request fields the vLLM-GCU flags ask for."""
    extra: dict[str, Any] = {}
    if args.strict_in_out_len:
        extra["min_tokens"] = output_len
    if args.keep_special_tokens:
        extra["skip_special_tokens"] = False
    return extra


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ValueError(f"--metric-percentiles: {exc}") from exc
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be numbers in (0, 100], got {text!r}")
    return values


def run_serve_benchmark(args: argparse.Namespace) -> int:
    """CLI entry: returns the exit code (1 when every request failed)."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf: all at once)")
    percentiles = parse_percentiles(args.metric_percentiles)
    if args.strict_in_out_len:
        if args.random_range_ratio != 0:
            raise ValueError("--strict-in-out-len needs --random-range-ratio 0 (exact lengths)")
        args.ignore_eos = True

    from model_server.benchmarks.random_prompts import load_tokenizer, sample_requests

    spec = default_tokenizer(args)
    served_root = None
    if args.tokenizer is None and spec is None:
        served_root = served_model_root(args)
        spec = default_tokenizer(args, served_root)
    note = ""
    if args.tokenizer is None and spec is not None:
        note = " (the served model's)"
        try:
            tokenizer, tokenizer_name = load_tokenizer(spec)
        except ValueError as exc:  # a model folder without tokenizer files, say
            tokenizer, tokenizer_name = load_tokenizer(None)
            note = f" (the served model's at {spec} does not load: {exc})"
    else:
        tokenizer, tokenizer_name = load_tokenizer(spec)
        if args.tokenizer is None:
            where = f"{served_root} is" if served_root else "the server names"
            note = f" (the served model: {where} no folder or file on this machine)"
    if args.dataset_name == "random":
        requests = sample_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
            tokenizer,
        )
    else:
        from model_server.benchmarks.copy_workloads import workload_requests

        requests = workload_requests(
            args.dataset_name, args.num_prompts, args.random_output_len, args.seed, tokenizer
        )
    print(f"tokenizer: {tokenizer_name}{note}", flush=True)
    summary = asyncio.run(benchmark(args, requests, percentiles, tokenizer_name))
    return 0 if summary["completed"] > 0 else 1


async def benchmark(
    args: argparse.Namespace,
    requests: list[SampleRequest],
    percentiles: list[float],
    tokenizer_name: str = "",
) -> dict[str, Any]:
    """Run the benchmark, print the report, save it if asked; returns the JSON summary."""
    import httpx

    from model_server.benchmarks.prefix_hits import (
        hit_rate,
        hit_rate_warning,
        parse_prefix_counters,
        read_metrics,
    )
    from model_server.benchmarks.serve_metrics import calculate_metrics, format_report, result_json
    from model_server.benchmarks.spec_counters import parse_spec_counters, spec_delta

    base_url = args.base_url.rstrip("/")
    url = base_url + "/" + args.endpoint.lstrip("/")
    # Read the environment here, not as the flag's default, so --help never prints the key.
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    chat = is_chat_endpoint(args.endpoint)
    # One connection per in-flight request: the pool must not become the bottleneck.
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        # A server that is still starting (refusing connections, answering 5xx) gets until
        # this deadline to come up; any other failure ends the run at once.
        deadline = time.monotonic() + max(0.0, args.ready_check_timeout_sec)
        model = args.model or await _wait_for_model(client, base_url, headers, deadline)

        # --lora-modules: each request's adapter, round robin over the requests.
        loras = args.lora_modules or []
        model_of = {id(r): loras[i % len(loras)] for i, r in enumerate(requests)} if loras else {}

        def payload(req: SampleRequest) -> dict[str, Any]:
            return build_payload(
                model=model_of.get(id(req), model),
                prompt=req.prompt,
                max_tokens=req.output_len,
                chat=chat,
                temperature=args.temperature,
                ignore_eos=args.ignore_eos,
                extra=extra_fields(args, req.output_len),
            )

        async def send(req: SampleRequest) -> RequestResult:
            return await stream_request(
                client, url, payload(req), prompt_len=req.prompt_len, headers=headers
            )

        if args.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...", flush=True)
            test = await _ready_check(send, requests[0], deadline)
            if not test.success:
                raise RuntimeError(f"initial test request to {url} failed: {test.error}")
            print("Initial test run completed. Starting main benchmark run...", flush=True)

        # One /metrics scrape before and one after: the prefix cache's and the drafts' counters.
        before = await read_metrics(client, base_url, headers) or ""
        start = time.perf_counter()
        results = await _run_all(send, requests, args.request_rate, args.max_concurrency, args)
        duration = time.perf_counter() - start
        after = await read_metrics(client, base_url, headers) or ""
        prefix_hit_rate = hit_rate(parse_prefix_counters(before), parse_prefix_counters(after))
        spec = spec_delta(parse_spec_counters(before), parse_spec_counters(after))

    metrics = calculate_metrics(results, duration, percentiles)
    failures = [r.error for r in results if not r.success]
    for i, err in enumerate(failures[:10]):
        print(f"Error {i}: {err}", file=sys.stderr)
    print(
        format_report(
            m=metrics,
            max_concurrency=args.max_concurrency,
            request_rate=args.request_rate,
            prefix_cache_hit_rate=prefix_hit_rate,
        )
    )
    if spec is not None:
        print(spec.describe())
    if args.dataset_name != "random":
        from model_server.benchmarks.copy_workloads import copy_share

        done = [(q.prompt, r.generated_text) for q, r in zip(requests, results, strict=True)]
        share = copy_share([p for p, _ in done], [a for _, a in done])
        if share is not None:
            print(f"answers' word trigrams found in their prompt: {share:.1%}")
    warning = hit_rate_warning(prefix_hit_rate, args.seed)
    if warning:
        print(warning, file=sys.stderr)
    summary = result_json(
        metrics,
        results,
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        base_url=base_url,
        endpoint=args.endpoint,
        model_id=model,
        tokenizer_id=tokenizer_name,
        num_prompts=len(requests),
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        prefix_cache_hit_rate=prefix_hit_rate,
    )
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        print(f"results saved to {args.save_result}", flush=True)
    return summary


async def first_model(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None
) -> str:
    """The id of the first model in `GET /v1/models` (errors as `served_models`')."""
    return str((await served_models(client, base_url, headers))[0]["id"])


async def served_models(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None
) -> list[dict[str, Any]]:
    """The model cards of `GET /v1/models` (at least one).

    Raises `ServerNotReady` when the server is unreachable or answers 5xx, `RuntimeError` for
    any other failure."""
    import httpx

    url = base_url + "/v1/models"
    try:
        r = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise ServerNotReady(
            f"cannot list models at {url} ({type(exc).__name__}: {exc}); is the server running?"
        ) from exc
    if r.status_code >= 500:
        raise ServerNotReady(f"cannot list models at {url}: HTTP {r.status_code}")
    try:
        r.raise_for_status()
        models = r.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise RuntimeError(f"cannot list models at {url} ({exc}); pass --model") from exc
    if not models or not all(isinstance(m, dict) and "id" in m for m in models):
        raise RuntimeError(f"{url} lists no model; pass --model")
    return models


class ServerNotReady(RuntimeError):
    """The server did not answer, or answered 5xx: it may still be starting."""


async def _wait_for_model(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None, deadline: float
) -> str:
    while True:
        try:
            return await first_model(client, base_url, headers)
        except ServerNotReady:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def _ready_check(send: Any, req: SampleRequest, deadline: float) -> RequestResult:
    """Send the first request, retrying while the server seems to be starting (no response
    or 5xx) until `deadline`; a 4xx or a broken stream is returned at once."""
    while True:
        result = await send(req)
        transient = result.status_code is None or result.status_code >= 500
        if result.success or not transient or time.monotonic() >= deadline:
            return result
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def _run_all(
    send: Any,
    requests: list[SampleRequest],
    request_rate: float,
    max_concurrency: int | None,
    args: argparse.Namespace,
) -> list[RequestResult]:
    """Launch every request on its arrival time; results in request order."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = _progress(len(requests), args)
    # A separate stream from the prompts' so arrivals do not change with the prompt source.
    rng = random.Random(args.seed + 1)

    async def one(req: SampleRequest) -> RequestResult:
        if semaphore is None:
            result = await send(req)
        else:
            async with semaphore:
                result = await send(req)
        if pbar is not None:
            pbar.update(1)
        return result

    tasks = []
    for i, req in enumerate(requests):
        if i > 0 and request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    if pbar is not None:
        pbar.close()
    return list(results)


def _progress(total: int, args: argparse.Namespace) -> Any:
    if args.disable_tqdm or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr)
