"""A real Wick stack on loopback (model server with the embedded SmolLM2, microservice in front)
after mixed traffic, scraped by a real Prometheus (Debian's package) with the scrape jobs of
compose's monitoring profile: every PromQL expression of the Grafana dashboard parses and returns
data. The same traffic checks request ids end to end (both services return and log them)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.conftest import ROOT, free_port
from tests.e2e.conftest import ServerProcess, launch
from tests.e2e.test_microservice import Microservice, start_microservice
from tests.promtool import prometheus_binary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DASHBOARD = ROOT / "helm" / "wick" / "dashboards" / "wick.json"
SCRAPE_CONFIG = ROOT / "compose" / "monitoring" / "prometheus.yml"
# Grafana's variables, as Grafana fills them in for one server of each; the rate window spans
# the whole test, so rate() sees the counters go from the scrape before the traffic to after
# it however long a loaded machine takes (scrapes time out while a busy server generates).
VARIABLES = {"$__rate_interval": "15m", "$model_server_job": ".+"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_covers_what_an_operator_asked_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for metric in (
        "http_requests_total", "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
        "llm_microservice_requests_total", "llm_microservice_upstream_errors_total",
        "llm_microservice_requests_in_flight", "llm_microservice_request_latency_seconds_bucket",
        "vllm:lora_requests_info",
    ):  # fmt: skip
        assert metric in exprs, metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Importable anywhere: every panel reads the datasource variable.
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    used = set(re.findall(r"\$\w+", exprs))
    assert used <= set(VARIABLES), used


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Microservice]]:
    log_dir = tmp_path_factory.mktemp("stack")
    server = launch(log_dir, "--enable-lora")  # vllm:lora_requests_info is LoRA's alone
    usvc = None
    try:
        server.wait_ready()
        usvc = start_microservice(
            log_dir, server.url, "generic", LLM_OPENAI_FORMAT_STREAMING="true"
        )
        usvc.wait_up()
        yield server, usvc
    finally:
        if usvc is not None:
            usvc.stop()
        server.stop()


@pytest.fixture(scope="module")
def prometheus(
    stack: tuple[ServerProcess, Microservice], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real Prometheus with compose's scrape jobs, pointed at the loopback stack, every second."""
    server, usvc = stack
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    where = {"wick-model-server": server.port, "wick-microservice": usvc.port}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(where)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{where[job['job_name']]}"]}]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (folder / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus did not get ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def traffic(server: ServerProcess, usvc: Microservice) -> None:
    """What a dashboard shows: streamed and whole answers through the microservice, a bad
    request, a stream the client drops, and a request straight to the model server."""
    chat = f"{usvc.url}/v1/chat/completions"
    for i in range(3):
        body = {"messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 12}
        assert httpx.post(chat, json=body, timeout=120).status_code == 200
        with httpx.stream("POST", chat, json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200 and list(r.iter_lines())
    assert httpx.post(chat, json={"messages": [{"role": "user"}]}, timeout=60).status_code == 422
    bad = {"messages": [{"role": "user"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=bad, timeout=60).status_code == 400
    long = {"messages": [{"role": "user", "content": "A long story, please."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", chat, json=long, timeout=120) as r:
        for _ in zip(range(5), r.iter_lines(), strict=False):
            pass  # leaving closes the connection: the model server aborts it
    done = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert done.status_code == 200


def query(url: str, expr: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    stack: tuple[ServerProcess, Microservice], prometheus: str
) -> None:
    server, usvc = stack

    def both_jobs_scraped() -> None:
        deadline = time.monotonic() + 60
        while len(query(prometheus, "up == 1")) < 2:
            assert time.monotonic() < deadline, query(prometheus, "up")
            time.sleep(0.5)

    both_jobs_scraped()  # a sample before the traffic: rate() needs the counters' rise
    traffic(server, usvc)
    both_jobs_scraped()  # and samples after it
    time.sleep(4)
    empty, no_number = [], []
    for title, expr in dashboard_queries():
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        result = query(prometheus, expr)
        if not result:
            empty.append(f"{title}: {expr}")
        elif not any(math.isfinite(float(s["value"][1])) for s in result):
            no_number.append(f"{title}: {expr} -> {result}")
    assert empty == [], "queries without data:\n" + "\n".join(empty)
    assert no_number == [], "queries without a number:\n" + "\n".join(no_number)
    # Errors by status show the 400 from both services.
    statuses = {
        s["metric"]["status"]
        for s in query(prometheus, "sum by (status) (llm_microservice_requests_total)")
    }
    assert {"200", "422"} <= statuses
    ms_statuses = query(prometheus, 'sum by (status) (http_requests_total{handler=~"/v1/.*"})')
    assert {"200", "400"} <= {s["metric"]["status"] for s in ms_statuses}


def test_request_ids_end_to_end(stack: tuple[ServerProcess, Microservice]) -> None:
    server, usvc = stack
    chat = f"{usvc.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    given = httpx.post(chat, json=body, headers={"X-Request-Id": "soak-abc-1"}, timeout=120)
    assert given.status_code == 200 and given.headers["x-request-id"] == "soak-abc-1"
    assert given.json()["id"] == "chatcmpl-soak-abc-1"
    made = httpx.post(chat, json=body, timeout=120)
    made_id = made.headers["x-request-id"]
    assert made.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", made_id)
    time.sleep(0.5)  # the log lines are written after the last byte
    for request_id in ("soak-abc-1", made_id):
        line = f"request {request_id}: POST /v1/chat/completions -> 200"
        assert line in usvc.log(), usvc.log()[-2000:]
        assert line in server.log(), server.log()[-2000:]
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert direct.json()["id"] == f"chatcmpl-{direct.headers['x-request-id']}"


def test_compose_scrape_config_names_the_services() -> None:
    targets = [
        t
        for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
        for g in job["static_configs"]
        for t in g["targets"]
    ]
    assert sorted(targets) == ["llm-microservice:9000", "model-server:8008"]
    assert Path(SCRAPE_CONFIG).is_file()
