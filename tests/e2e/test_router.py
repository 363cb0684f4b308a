"""Wick replicas behind vLLM's router (`vllm-router`, the real binary from PyPI) with its
cache-aware policy: requests sharing a long prefix land on one replica (seen in the replicas' own
prefix-cache and request metrics), unrelated ones spread, the OPEA microservice works through the
router, and a replica killed mid-run loses no request (the router retries it on another). Its
`kv_aware` policy, fed by Wick's KV events (--kv-events-config), sends a request to the replica
whose cache holds its prefix."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from model_server.loader import load_model_source
from tests.e2e.conftest import ServerProcess, metric
from tests.e2e.test_microservice import start_microservice
from tests.e2e.vllm_router import Router, start_replicas, start_router
from tests.loopback import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORDS = ("Lighthouses", "Volcanoes", "Quasars", "Bicycles", "Mushrooms", "Glaciers")


@dataclass
class Fleet:
    router: Router
    replicas: list[ServerProcess]
    log_dir: Path
    kv_events: list[tuple[int, int]]  # each replica's KV-event (publish, replay) ports


def kv_events_args(pub: int, replay: int) -> tuple[str, str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return "--kv-events-config", json.dumps(config)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three replicas behind `vllm-router --policy cache_aware`. Each also publishes its KV
    events, for the kv_aware router of the last test (one fleet for both: the replicas' start
    is most of this module's time)."""
    log_dir = tmp_path_factory.mktemp("router")
    ports = [(free_port(), free_port()) for _ in range(3)]
    replicas = start_replicas(log_dir, [kv_events_args(*pair) for pair in ports])
    router = start_router(log_dir, [r.url for r in replicas], "--policy", "cache_aware")
    try:
        router.wait_ready()
        yield Fleet(router, replicas, log_dir, ports)
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()


def finished(replica: ServerProcess) -> float:
    """Requests the replica finished (every request here ends by length: ignore_eos)."""
    return metric(replica.url, "vllm:request_success_total", 'finished_reason="length"')


def prefix_hits(replica: ServerProcess) -> float:
    return metric(replica.url, "vllm:prefix_cache_hits_total")


def complete(base_url: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_shared_prefix_lands_on_one_replica(fleet: Fleet) -> None:
    # ~250 tokens of system prompt, unique to this run so no replica holds it already.
    tag = uuid.uuid4().hex
    prefix = f"[{tag}] You are the support assistant of the Wick serving stack. " * 10
    before = [(finished(r), prefix_hits(r)) for r in fleet.replicas]
    for i in range(6):
        complete(fleet.router.url, f"{prefix}\nQuestion {i}: how do I scale out?")
    after = [(finished(r), prefix_hits(r)) for r in fleet.replicas]
    served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 0, 6], f"requests per replica: {served}"
    owner = served.index(6)
    # The five requests after the first found the prefix's blocks on that replica.
    assert hits[owner] >= 5 * 200, f"prefix-cache hits per replica: {hits}"
    assert [h for i, h in enumerate(hits) if i != owner] == [0, 0]


@pytest.mark.parametrize(
    "name",
    # What the Gateway API Inference Extension's endpoint picker scrapes from a vLLM model
    # server (its model-server protocol): queue length and KV cache utilisation.
    ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
)
def test_replicas_export_the_inference_extensions_metrics(fleet: Fleet, name: str) -> None:
    for replica in fleet.replicas:
        assert 0 <= metric(replica.url, name) <= (1 if "usage" in name else 10**6)


def test_unrelated_prompts_spread(fleet: Fleet) -> None:
    """Without a prefix match the policy picks the least loaded replica, so unrelated requests
    arriving together spread (one at a time, every replica is equally idle)."""
    prompts = [f"{uuid.uuid4().hex} {word} are interesting because" for word in WORDS]
    before = [finished(r) for r in fleet.replicas]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: complete(fleet.router.url, p, 32), prompts))
    served = [finished(r) - b for r, b in zip(fleet.replicas, before, strict=True)]
    assert sum(served) == len(prompts)
    assert sum(1 for s in served if s > 0) >= 2, f"requests per replica: {served}"


def test_the_microservice_works_through_the_router(fleet: Fleet) -> None:
    usvc = start_microservice(fleet.log_dir, fleet.router.url, "generic")
    try:
        usvc.wait_up()
        health = httpx.get(f"{usvc.url}/v1/health_check", timeout=30)
        assert health.status_code == 200, health.text
        before = sum(finished(r) for r in fleet.replicas)
        payload = {
            "messages": {"system": "You are a helpful assistant.", "user": "Name a colour."},
            "max_new_tokens": 5,
            "ignore_eos": True,
            "streaming": False,
        }
        response = httpx.post(f"{usvc.url}/v1/chat/completions", json=payload, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["text"]
        assert sum(finished(r) for r in fleet.replicas) == before + 1
    finally:
        assert usvc.stop() == 0, usvc.log()[-3000:]


def test_killing_a_replica_mid_run_loses_no_request(fleet: Fleet) -> None:
    """Runs after the cache_aware tests: it leaves two replicas (for the kv_aware test)."""
    victim = fleet.replicas[1]
    prompts = [f"Story {i} {uuid.uuid4().hex}: once upon a time" for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, fleet.router.url, p, 48) for p in prompts]
        # Kill once the victim is working on some of them (its running gauge says so).
        deadline = time.monotonic() + 60
        while metric(victim.url, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the victim never got a request"
            time.sleep(0.05)
        os.kill(victim.proc.pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r["usage"]["completion_tokens"] for r in results] == [48] * len(prompts)
    # The router did meet the dead replica, and retried on the others.
    assert f"worker_url={victim.url}" in fleet.router.log()


# ------------------------------------------------------------- kv_aware, fed by Wick's events


@pytest.fixture(scope="module")
def kv_fleet(fleet: Fleet) -> Iterator[Fleet]:
    """Two of the fleet's replicas (the first two alive: the kill test leaves two) behind
    `vllm-router --policy kv_aware` subscribed to their KV events (live and replay endpoints),
    tokenizing with the served model's tokenizer.json."""
    log_dir = fleet.log_dir / "kv-router"
    log_dir.mkdir()
    tokenizer_dir = log_dir / "tokenizer"
    load_model_source(None).tokenizer.save_pretrained(tokenizer_dir)
    live = [i for i, replica in enumerate(fleet.replicas) if replica.proc.poll() is None][:2]
    assert len(live) == 2, "the fleet lost more than one replica"
    replicas = [fleet.replicas[i] for i in live]
    ports = [fleet.kv_events[i] for i in live]
    sources = []
    for replica, (pub, replay) in zip(replicas, ports, strict=True):
        sources += ["--kv-event-source", f"{replica.url}=tcp://127.0.0.1:{pub}"]
        sources += ["--kv-event-replay-source", f"{replica.url}=tcp://127.0.0.1:{replay}"]
    router = start_router(
        log_dir,
        [r.url for r in replicas],
        *("--policy", "kv_aware", "--kv-event-block-size", "16"),
        *("--kv-event-model", MODEL, *sources),
        env={"VLLM_ROUTER_TOKENIZER": str(tokenizer_dir)},
    )
    try:
        router.wait_ready()
        yield Fleet(router, replicas, log_dir, ports)
    finally:
        router.stop()


def test_kv_aware_routes_to_the_replica_holding_the_prefix(kv_fleet: Fleet) -> None:
    first, second = kv_fleet.replicas
    # Each replica computes a long prefix of its own, sent to it directly: the router learns
    # where the blocks are only from the replicas' KV events.
    prefixes = {
        0: "The lighthouse keeper wrote in his log every evening about the ships. " * 8,
        1: "A quiet harbour town kept its archives in a stone tower by the sea. " * 8,
    }
    complete(second.url, prefixes[1] + "Once")
    complete(first.url, prefixes[0] + "Once")
    time.sleep(1.0)  # the events reach the router's index
    for i in range(3):
        for owner in (1, 0):
            before = [(finished(r), prefix_hits(r)) for r in kv_fleet.replicas]
            complete(kv_fleet.router.url, f"{prefixes[owner]}Then {i}")
            after = [(finished(r), prefix_hits(r)) for r in kv_fleet.replicas]
            served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
            assert served == [1 if j == owner else 0 for j in range(2)], (
                f"a request with replica {owner}'s prefix went to {served}:\n"
                f"{kv_fleet.router.log()[-3000:]}"
            )
            # ... where its prefix's blocks were found (its 6 full blocks of 16 tokens).
            assert after[owner][1] - before[owner][1] >= 6 * 16
