"""compose/scale-out.yaml resolved by the real compose v2 binary: replicas behind vLLM's router
(and its image, docker/Dockerfile.router), and one model over two "nodes"; the two-node example
run natively as compose would start it (each service's command and environment, on loopback)
answers the same greedy text as one node."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.conftest import ROOT, clean_env, compose_binary, free_port, hadolint_binary
from tests.e2e.conftest import ServerProcess

SCALE_OUT = ROOT / "compose" / "scale-out.yaml"
ROUTER_DOCKERFILE = ROOT / "docker" / "Dockerfile.router"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def compose_config(profile: str, **env: str) -> dict[str, Any]:
    cmd = [str(compose_binary()), "-f", str(SCALE_OUT), "--profile", profile]
    cmd += ["config", "--format", "json"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def test_replicas_behind_the_router() -> None:
    services = compose_config("router")
    replicas = sorted(s for s in services if s.startswith("model-server-"))
    assert len(replicas) >= 2
    assert set(services) == {*replicas, "vllm-router", "llm-microservice-router"}
    command = services["vllm-router"]["command"]
    urls = command[command.index("--worker-urls") + 1 :]
    assert urls == [f"http://{r}:8008" for r in replicas]
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert services["vllm-router"]["depends_on"].keys() == set(replicas)
    usvc = services["llm-microservice-router"]["environment"]
    assert usvc["LLM_MODEL_SERVER_ENDPOINT"] == "http://vllm-router:8008"
    # Replicas publish no host port of their own (they would collide): the router does.
    assert all(not services[r].get("ports") for r in replicas)
    assert services["vllm-router"]["ports"][0]["target"] == 8008


def test_the_router_image() -> None:
    proc = subprocess.run(
        [str(hadolint_binary()), "-t", "warning", "--no-color", str(ROUTER_DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parser = DockerfileParser(fileobj=io.BytesIO(ROUTER_DOCKERFILE.read_bytes()))
    froms = [i["value"] for i in parser.structure if i["instruction"] == "FROM"]
    assert all(f.split()[0] == "${BASE_IMAGE}" for f in froms)
    last = max(i for i, ins in enumerate(parser.structure) if ins["instruction"] == "FROM")
    stage = parser.structure[last + 1 :]
    values = {ins["instruction"]: ins["value"] for ins in stage}
    assert values["USER"] == "1000:1000"
    entrypoint = json.loads(values["ENTRYPOINT"])
    assert entrypoint[:5] == ["vllm-router", "--host", "0.0.0.0", "--port", "8008"]
    assert "/health" in values["HEALTHCHECK"]


def _start(log: Path, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "model_server", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )


def _greedy(url: str) -> str:
    body = {"model": MODEL, "prompt": "The sea at night is", "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_two_node_example_answers_as_one_node(tmp_path: Path) -> None:
    # float32: TP=2 adds partial products in another order; equal texts need fp32 precision.
    services = compose_config("multinode", LLM_DTYPE="float32")
    node0, node1 = services["node0"], services["node1"]
    assert node0["command"] == ["serve"] and node1["command"][0] == "worker"
    assert {node0["environment"][k] for k in ("MASTER_ADDR",)} == {"node0"}
    assert node1["environment"]["MASTER_ADDR"] == "node0"
    assert (node0["environment"]["NODE_RANK"], node1["environment"]["NODE_RANK"]) == ("0", "1")
    assert node0["environment"]["NNODES"] == node1["environment"]["NNODES"] == "2"

    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    # Sized for this machine (the compose services take the defaults): the same on every node.
    sizing = {"LLM_KV_CACHE_MEMORY": "96MiB", "LLM_MAX_MODEL_LEN": "1024"}
    flags = ["--kv-cache-memory", "96MiB", "--max-model-len", "1024"]
    # On one host the service names become loopback; the container paths stay out.
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}

    def environment(service: dict[str, Any]) -> dict[str, str]:
        env = {
            k: v
            for k, v in service["environment"].items()
            if v is not None and k not in ("HF_HOME", "WICK_CACHE_DIR")
        }
        return {**base, **env, **sizing, **rendezvous}

    port = free_port()
    serve = ["--host", "127.0.0.1", "--port", str(port)]
    processes = []
    try:
        worker = _start(tmp_path / "node1.log", [*node1["command"], *flags], environment(node1))
        processes.append(worker)
        leader = _start(tmp_path / "node0.log", [*node0["command"], *serve], environment(node0))
        processes.append(leader)
        ServerProcess(leader, port, tmp_path / "node0.log").wait_ready()
        two_nodes = _greedy(f"http://127.0.0.1:{port}")
        leader.terminate()
        assert leader.wait(60) == 0
        assert worker.wait(60) == 0

        single = {k: v for k, v in environment(node0).items() if k not in rendezvous}
        single = {**single, "LLM_TP_SIZE": "1", "NNODES": "1", "NODE_RANK": "0"}
        port = free_port()
        one = _start(
            tmp_path / "one.log", ["serve", "--host", "127.0.0.1", "--port", str(port)], single
        )
        processes.append(one)
        ServerProcess(one, port, tmp_path / "one.log").wait_ready()
        assert _greedy(f"http://127.0.0.1:{port}") == two_nodes
        assert len(two_nodes.split()) > 5
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
