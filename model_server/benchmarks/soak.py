"""`bench soak`: minutes of mixed traffic through the LLM microservice (or straight to the model
server), watching that nothing is lost and nothing leaks.

`--concurrency` clients loop until `--duration-minutes` is up, each request drawn at random:
a streamed answer read to the end, a whole (non-streamed) answer, a stream the client drops
after a few pieces (`--cancel-fraction`), a bad request that must get a 4xx (`--bad-fraction`),
or a hostile one that must get a 4xx quickly without disturbing the others
(`--hostile-fraction`: a body nested 100,000 deep, a 64 MiB body, 100,000 prompts, 100,000 RAG
documents, 200,000 messages, a 10 MB /tokenize, a lone surrogate; see HOSTILE). Prints requests
ok / failed / cancelled / rejected-as-bad / hostile-rejected / shed (503),
p50 and p99 latency of the answered ones, and the model server's RSS, KV cache usage and
running/waiting requests (from its /metrics) at the start, every `--report-every-s` seconds and
at the end, after the traffic stops and the engine settles.

"Lost" is the number of requests sent that the front service did not count (its
`llm_microservice_requests_total`, when the target is the microservice) or that got no outcome
here. Exit code 1 when a request failed or was lost, or the KV cache is not back to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

CHAT_PATH = "/v1/chat/completions"
MIB = 1024 * 1024
# Prompts of a few lengths, so prefix caching, chunked prefill and batching all get exercised.
TOPICS = ("the sea", "a lighthouse", "bread", "a dragon", "rain in the city", "chess", "bees")
STYLES = ("Answer in one sentence.", "Be brief.", "Write a short poem.", "Explain to a child.")
# Requests that a correct server must refuse with a 4xx (and keep serving).
BAD_REQUESTS: tuple[Any, ...] = (
    {"messages": [{"role": "user"}]},  # no content
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"},
    b'{"messages": [{"role": "user", "content": "hi"',  # truncated JSON
)
SERVICE_COUNTER = "llm_microservice_requests_total"


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


# Requests an attacker or a careless client sends (issue 30's list), each of which a correct
# server answers with a 4xx at once: (name, "front" for --base-url or "model" for the model
# server, path, body builder). Bodies are built once, on first use.
HOSTILE: tuple[tuple[str, str, str, Any], ...] = (
    ("deep body", "front", CHAT_PATH, lambda: b"[" * 100_000 + b"]" * 100_000),
    (
        "64 MiB body",
        "front",
        CHAT_PATH,
        lambda: b'{"messages": [{"role": "user", "content": "' + b"a" * (64 * MIB) + b'"}]}',
    ),
    # The model server refuses it (400); the microservice replaces it with U+FFFD, as browsers
    # do, since a text splitter can cut an emoji of a RAG document in half.
    (
        "lone surrogate",
        "model",
        CHAT_PATH,
        lambda: b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
    ),
    (
        "100,000 documents",
        "front",
        CHAT_PATH,
        lambda: _json_bytes(
            {"query": "What is this about?", "documents": ["Some text."] * 100_000}
        ),
    ),
    (
        "100,000 prompts",
        "model",
        "/v1/completions",
        lambda: _json_bytes({"prompt": ["hi"] * 100_000, "max_tokens": 1}),
    ),
    (
        "200,000 messages",
        "model",
        CHAT_PATH,
        lambda: _json_bytes({"messages": [{"role": "user", "content": "hi"}] * 200_000}),
    ),
    ("10 MB /tokenize", "model", "/tokenize", lambda: _json_bytes({"prompt": "hi " * 3_500_000})),
)


@cache
def hostile_body(name: str, build: Any) -> bytes:
    """`build()`'s body, built once (the 64 MiB one is reused, not rebuilt per request)."""
    return build()


def add_bench_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:9000",
        help="Where the traffic goes: the LLM microservice (or the model server) root URL.",
    )
    parser.add_argument(
        "--model-server-url",
        default="http://127.0.0.1:8008",
        help="The model server whose /metrics give RSS and KV cache usage.",
    )
    parser.add_argument("--duration-minutes", type=float, default=20.0, help="Traffic duration.")
    parser.add_argument("--concurrency", type=int, default=4, help="Clients sending at once.")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request.")
    parser.add_argument(
        "--stream-fraction", type=float, default=0.5, help="Share of answers streamed."
    )
    parser.add_argument(
        "--cancel-fraction",
        type=float,
        default=0.1,
        help="Share of requests whose stream the client drops after a few pieces.",
    )
    parser.add_argument(
        "--bad-fraction", type=float, default=0.05, help="Share of malformed requests."
    )
    parser.add_argument(
        "--hostile-fraction",
        type=float,
        default=0.0,
        help="Share of hostile requests (oversized, deeply nested, floods of prompts, documents "
        "or messages, lone surrogates), each of which must get a 4xx.",
    )
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=None,
        help="Exit 1 when the model server's RSS at the end is more than this above its level "
        "after the first report (unset: report only).",
    )
    parser.add_argument(
        "--report-every-s", type=float, default=60.0, help="Seconds between progress lines."
    )
    parser.add_argument(
        "--request-timeout-s", type=float, default=300.0, help="Per-request timeout."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the traffic mix.")


# --------------------------------------------------------------------------------- tallies


@dataclass(slots=True)
class Tally:
    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    bad_rejected: int = 0  # bad requests answered 4xx, as they must be
    hostile_rejected: int = 0  # hostile requests answered 4xx, as they must be
    hostile_latencies_s: list[float] = field(default_factory=list)
    shed: int = 0  # 503 (backpressure or draining): the server said "later"
    sent: int = 0
    sent_to_model_server: int = 0  # hostile requests sent past the front: it never counts them
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        if why not in self.errors:  # each new kind as it happens, not only in the summary
            print(f"  failure: {why}", flush=True)
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1

    @property
    def outcomes(self) -> int:
        return (
            self.ok + self.failed + self.cancelled + self.bad_rejected + self.hostile_rejected
            + self.shed
        )  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class ServerState:
    rss_bytes: float | None
    kv_usage: float | None
    running: float | None
    waiting: float | None

    def describe(self) -> str:
        def fmt(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        rss = None if self.rss_bytes is None else self.rss_bytes / MIB
        kv = None if self.kv_usage is None else self.kv_usage * 100
        return (
            f"RSS {fmt(rss, '.1f')} MiB, KV cache {fmt(kv, '.1f')}%, running "
            f"{fmt(self.running, '.0f')}, waiting {fmt(self.waiting, '.0f')}"
        )


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every series of `name` in a Prometheus exposition (None: absent)."""
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values) if values else None


async def server_state(client: httpx.AsyncClient, model_server_url: str) -> ServerState:
    try:
        text = (await client.get(f"{model_server_url}/metrics", timeout=10)).text
    except Exception:
        return ServerState(None, None, None, None)
    return ServerState(
        metric_sum(text, "process_resident_memory_bytes"),
        metric_sum(text, "vllm:kv_cache_usage_perc"),
        metric_sum(text, "vllm:num_requests_running"),
        metric_sum(text, "vllm:num_requests_waiting"),
    )


async def service_count(client: httpx.AsyncClient, base_url: str) -> float | None:
    """Requests the microservice has answered (None: the target is not the microservice)."""
    try:
        text = (await client.get(f"{base_url}/metrics", timeout=10)).text
    except Exception:
        return None
    return metric_sum(text, SERVICE_COUNTER)


# ------------------------------------------------------------------------------- requests


def _messages(rng: random.Random) -> list[dict[str, str]]:
    topic = rng.choice(TOPICS)
    return [
        {"role": "system", "content": "You are a helpful assistant. " + rng.choice(STYLES)},
        {"role": "user", "content": f"Tell me about {topic}." + " Please." * rng.randint(0, 40)},
    ]


def _stream_failed(line: str) -> str | None:
    """The error of an error event in a stream (OpenAI chunks or OPEA's repr lines)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data.startswith("{") and '"error"' in data:
        try:
            return str(json.loads(data)["error"].get("message", data))[:200]
        except (ValueError, KeyError, AttributeError):
            return data[:200]
    return None


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, tally: Tally
) -> None:
    url = f"{args.base_url}{CHAT_PATH}"
    headers = {"X-Request-Id": f"soak-{uuid.uuid4().hex}"}
    draw = rng.random()
    tally.sent += 1
    started = time.monotonic()
    try:
        if draw < args.hostile_fraction:
            await hostile_request(client, args, rng, tally, headers)
            return
        draw -= args.hostile_fraction
        if draw < args.bad_fraction:
            bad = rng.choice(BAD_REQUESTS)
            if isinstance(bad, bytes):
                headers["Content-Type"] = "application/json"
                resp = await client.post(url, content=bad, headers=headers)
            else:
                resp = await client.post(url, json=bad, headers=headers)
            if 400 <= resp.status_code < 500:
                tally.bad_rejected += 1
            else:
                tally.fail(f"bad request answered {resp.status_code}")
            return
        body = {"messages": _messages(rng), "max_tokens": args.max_tokens, "temperature": 0.7}
        cancel = draw < args.bad_fraction + args.cancel_fraction
        stream = cancel or rng.random() < args.stream_fraction
        if not stream:
            resp = await client.post(url, json=body, headers=headers)
            if resp.status_code == 200:
                tally.ok += 1
                tally.latencies_s.append(time.monotonic() - started)
            elif resp.status_code == 503:
                tally.shed += 1
            else:
                tally.fail(f"HTTP {resp.status_code}: {resp.text[:120]}")
            return
        body["stream"] = True
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                if resp.status_code == 503:
                    tally.shed += 1
                else:
                    tally.fail(f"HTTP {resp.status_code}: {resp.text[:120]}")
                return
            pieces, done = 0, False
            async for line in resp.aiter_lines():
                if (error := _stream_failed(line)) is not None:
                    tally.fail(f"stream error: {error}")
                    return
                if line.startswith("data:"):
                    pieces += 1
                    done = line[5:].strip() == "[DONE]"
                if cancel and pieces >= 3:
                    tally.cancelled += 1  # leaving the block drops the connection
                    return
        if done:
            tally.ok += 1
            tally.latencies_s.append(time.monotonic() - started)
        elif cancel:  # the answer ended before three pieces: it was not cancelled
            tally.ok += 1
        else:
            tally.fail("stream ended without [DONE]")
    except Exception as exc:
        tally.fail(f"{type(exc).__name__}: {str(exc)[:120]}")


async def hostile_request(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    rng: random.Random,
    tally: Tally,
    headers: dict[str, str],
) -> None:
    name, target, path, build = rng.choice(HOSTILE)
    root = args.base_url if target == "front" else args.model_server_url
    if root != args.base_url:
        tally.sent_to_model_server += 1
    body = hostile_body(name, build)
    started = time.monotonic()
    resp = await client.post(
        f"{root}{path}", content=body, headers={**headers, "Content-Type": "application/json"}
    )
    tally.hostile_latencies_s.append(time.monotonic() - started)
    if 400 <= resp.status_code < 500:
        tally.hostile_rejected += 1
    else:
        tally.fail(f"hostile {name} answered {resp.status_code}: {resp.text[:120]}")


async def worker(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    rng: random.Random,
    tally: Tally,
    deadline: float,
) -> None:
    while time.monotonic() < deadline:
        await one_request(client, args, rng, tally)


# ---------------------------------------------------------------------------------- report


def progress_line(elapsed_s: float, tally: Tally, state: ServerState) -> str:
    p50 = percentile(tally.latencies_s, 50)
    p99 = percentile(tally.latencies_s, 99)
    return (
        f"[{elapsed_s / 60:5.1f} min] ok {tally.ok}, failed {tally.failed}, cancelled "
        f"{tally.cancelled}, bad->4xx {tally.bad_rejected}, hostile->4xx "
        f"{tally.hostile_rejected}, shed(503) {tally.shed} | "
        f"latency p50 {p50:.2f}s p99 {p99:.2f}s | {state.describe()}"
    )


async def settle(
    client: httpx.AsyncClient, model_server_url: str, timeout_s: float = 30.0
) -> ServerState:
    """The model server's state once nothing runs or waits (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await server_state(client, model_server_url)
        idle = state.running == 0 and state.waiting == 0 and state.kv_usage == 0
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace) -> int:
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency + 8)
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start_state = await server_state(client, args.model_server_url)
        counted_before = await service_count(client, args.base_url)
        print(
            f"soak: {args.duration_minutes:g} min, {args.concurrency} clients -> "
            f"{args.base_url}{CHAT_PATH} (stream {args.stream_fraction:.0%}, cancel "
            f"{args.cancel_fraction:.0%}, bad {args.bad_fraction:.0%}, hostile "
            f"{args.hostile_fraction:.0%}, max_tokens {args.max_tokens})",
            flush=True,
        )
        print(f"[start] {start_state.describe()}", flush=True)
        tally = Tally()
        began = time.monotonic()
        deadline = began + args.duration_minutes * 60.0
        rng = random.Random(args.seed)
        workers = [
            asyncio.ensure_future(
                worker(client, args, random.Random(rng.random()), tally, deadline)
            )
            for _ in range(args.concurrency)
        ]
        states: list[ServerState] = [start_state]
        next_report = began + args.report_every_s
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=max(0.0, next_report - time.monotonic()))
            if time.monotonic() >= next_report:
                state = await server_state(client, args.model_server_url)
                states.append(state)
                print(progress_line(time.monotonic() - began, tally, state), flush=True)
                next_report += args.report_every_s
        await asyncio.gather(*workers)
        traffic_s = time.monotonic() - began
        end_state = await settle(client, args.model_server_url)
        counted_after = await service_count(client, args.base_url)

    lost = tally.sent - tally.outcomes
    front_sent = tally.sent - tally.sent_to_model_server
    if counted_before is not None and counted_after is not None:
        lost = max(lost, front_sent - int(counted_after - counted_before))
    print(progress_line(traffic_s, tally, end_state), flush=True)
    print(f"[end] after the traffic stopped: {end_state.describe()}")
    print(f"requests sent: {tally.sent} in {traffic_s:.0f}s ({tally.sent / traffic_s:.2f}/s)")
    print(
        f"  ok {tally.ok}, failed {tally.failed}, cancelled {tally.cancelled}, "
        f"bad->4xx {tally.bad_rejected}, hostile->4xx {tally.hostile_rejected}, "
        f"shed(503) {tally.shed}, lost {lost}"
    )
    if tally.hostile_latencies_s:
        print(
            f"hostile requests answered in: p50 {percentile(tally.hostile_latencies_s, 50):.2f}s,"
            f" max {max(tally.hostile_latencies_s):.2f}s"
        )
    for why, count in sorted(tally.errors.items(), key=lambda kv: -kv[1]):
        print(f"  failure x{count}: {why}")
    p50, p99 = percentile(tally.latencies_s, 50), percentile(tally.latencies_s, 99)
    print(f"latency of answered requests: p50 {p50:.2f}s, p99 {p99:.2f}s")
    rss = [s.rss_bytes for s in states if s.rss_bytes is not None]
    rss_ok = True
    if end_state.rss_bytes is not None and rss:
        # Warm-up: the first report (allocator pools, caches filled by the first minutes).
        warm = rss[1] if len(rss) > 1 else rss[0]
        print(
            f"model server RSS: start {rss[0] / MIB:.1f} MiB, after warm-up {warm / MIB:.1f} MiB, "
            f"peak {max([*rss, end_state.rss_bytes]) / MIB:.1f} MiB, end "
            f"{end_state.rss_bytes / MIB:.1f} MiB (growth since warm-up "
            f"{(end_state.rss_bytes - warm) / MIB:+.1f} MiB)"
        )
        limit = args.max_rss_growth_mib
        if limit is not None and (end_state.rss_bytes - warm) / MIB > limit:
            rss_ok = False
            print(f"  <-- RSS grew more than --max-rss-growth-mib {limit:g}")
    kv_clean = end_state.kv_usage == 0
    print(f"KV cache at the end: {end_state.kv_usage}" + ("" if kv_clean else "  <-- NOT FREED"))
    return 0 if tally.failed == 0 and lost == 0 and kv_clean and rss_ok else 1


def run_soak_benchmark(args: argparse.Namespace) -> int:
    for name in ("stream_fraction", "cancel_fraction", "bad_fraction", "hostile_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise SystemExit(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.cancel_fraction + args.bad_fraction + args.hostile_fraction > 1.0:
        raise SystemExit(
            "--cancel-fraction + --bad-fraction + --hostile-fraction must be at most 1"
        )
    if args.concurrency < 1 or args.duration_minutes <= 0 or args.report_every_s <= 0:
        raise SystemExit("--concurrency, --duration-minutes and --report-every-s must be > 0")
    return asyncio.run(soak(args))
