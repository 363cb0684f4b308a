"""run_server.sh: its one-line errors, the compose command it runs when an engine is there (with
a stand-in `docker`), and (e2e) the whole stack started natively on the CPU with no
configuration: both services ready, the OPEA seed's requests answered, `promtool check metrics`
on real scrapes of both, SIGTERM stopping both and freeing the ports."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.conftest import ROOT, clean_env, free_port
from tests.promtool import promtool_check_metrics

SCRIPT = ROOT / "run_server.sh"
READY_TIMEOUT_S = 600
# The OPEA seed's requests (opea-vllm-model-server-README.md), with fewer tokens.
SEED_SYSTEM = (
    "### You are a helpful, respectful, and honest assistant to help the user with questions. "
    "Please refer to the search results obtained from the local knowledge base. ### Search "
    "results:  \n\n"
)


def run_script(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    proc = subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No settings at all, an empty .env, free ports, logs under tmp_path."""
    env_file = tmp_path / "empty.env"
    env_file.touch()
    settings = {
        "WICK_ENV_FILE": str(env_file),
        "WICK_LOG_DIR": str(tmp_path / "logs"),
        "LLM_MODEL_SERVER_PORT": str(free_port()),
        "LLM_USVC_PORT": str(free_port()),
    }
    return clean_env(**(settings | extra))


def assert_one_error_line(rc: int, stderr: str, *words: str) -> None:
    assert rc != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    for word in words:
        assert word in lines[0], lines[0]


def path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH with only bash, env, dirname and python3 (linked into tmp_path/bin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # The real interpreter, not a shim (pyenv's need their own PATH).
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    for tool in ("bash", "env", "dirname", *tools):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(os.path.realpath(found))
    return str(bin_dir)


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize("device", ["tpu", "rocm", "gpu"])
def test_unsupported_device(tmp_path: Path, device: str) -> None:
    rc, _, err = run_script("--native", env=base_env(tmp_path, LLM_DEVICE=device))
    assert_one_error_line(rc, err, f"'{device}'", "cpu, cuda, gcu, hpu")


def test_device_from_dotenv_and_environment_wins(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    Path(env["WICK_ENV_FILE"]).write_text("# comment\nexport LLM_DEVICE='tpu'  # inline\n")
    rc, _, err = run_script("--native", env=env)
    assert_one_error_line(rc, err, "'tpu'")  # .env was read
    rc, _, err = run_script("--native", env={**env, "LLM_DEVICE": "bogus"})
    assert_one_error_line(rc, err, "'bogus'")  # the environment wins over .env


@pytest.mark.parametrize(
    ("device", "module", "words"),
    [("hpu", "habana_frameworks", ("habana_frameworks",)), ("gcu", "torch_gcu", ("torch_gcu",))],
)
def test_missing_device_runtime_native(
    tmp_path: Path, device: str, module: str, words: tuple[str, ...]
) -> None:
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed: this machine has the {device} runtime")
    rc, _, err = run_script("--native", env=base_env(tmp_path, LLM_DEVICE=device))
    assert_one_error_line(rc, err, f"LLM_DEVICE={device}", *words)


def test_missing_nvidia_driver(tmp_path: Path) -> None:
    env = base_env(tmp_path, LLM_DEVICE="cuda", PATH=path_without(tmp_path))
    rc, _, err = run_script(env=env)  # no docker on PATH either: native
    assert_one_error_line(rc, err, "LLM_DEVICE=cuda", "nvidia-smi")


@pytest.mark.parametrize("variable", ["LLM_MODEL_SERVER_PORT", "LLM_USVC_PORT"])
def test_busy_port(tmp_path: Path, variable: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = base_env(tmp_path, **{variable: str(port)})
        rc, _, err = run_script("--native", env=env)
    assert_one_error_line(rc, err, f"port {port}", variable, "already in use")


def test_same_port_twice_and_bad_port(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    env["LLM_USVC_PORT"] = env["LLM_MODEL_SERVER_PORT"]
    rc, _, err = run_script("--native", env=env)
    assert_one_error_line(rc, err, "both")
    rc, _, err = run_script("--native", env={**env, "LLM_USVC_PORT": "90000"})
    assert_one_error_line(rc, err, "LLM_USVC_PORT", "90000")


# ------------------------------------------------------------------------ compose mode

FAKE_DOCKER = """#!/usr/bin/env bash
# A stand-in Docker CLI: an engine is "reachable"; `compose ... up` is recorded, not run.
case "$1 $2" in
  "info "*) exit 0 ;;
  "compose version") echo "Docker Compose version v2.40.3"; exit 0 ;;
esac
python3 - "$@" <<'PY'
import json, os, sys
record = {"argv": sys.argv[1:], "profiles": os.environ.get("COMPOSE_PROFILES"),
          "port": os.environ.get("LLM_USVC_PORT")}
json.dump(record, open(os.environ["FAKE_DOCKER_LOG"], "w"))
PY
"""


@pytest.fixture
def fake_docker(tmp_path: Path) -> Iterator[dict[str, str]]:
    bin_dir = Path(path_without(tmp_path, "timeout", "sed"))
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    yield base_env(tmp_path, PATH=str(bin_dir), FAKE_DOCKER_LOG=str(tmp_path / "docker.json"))


def test_compose_mode_runs_the_device_profile(tmp_path: Path, fake_docker: dict[str, str]) -> None:
    Path(fake_docker["WICK_ENV_FILE"]).write_text("LLM_DEVICE=cpu\n")
    rc, _, err = run_script("-d", "--build", env=fake_docker)
    assert rc == 0, err
    record = json.loads((tmp_path / "docker.json").read_text())
    assert record["argv"] == [
        "compose", "-f", str(ROOT / "compose" / "docker-compose.yaml"),
        "--env-file", str(ROOT / "compose" / "cpu.env"),
        "--env-file", fake_docker["WICK_ENV_FILE"],
        "--profile", "cpu", "up", "-d", "--build",
    ]  # fmt: skip
    assert record["profiles"] == "cpu"
    assert record["port"] == fake_docker["LLM_USVC_PORT"]


def test_native_flag_skips_compose(tmp_path: Path, fake_docker: dict[str, str]) -> None:
    # --native with an engine present: straight to the native checks (here: a runtime error).
    rc, _, err = run_script("--native", env={**fake_docker, "LLM_DEVICE": "cuda"})
    assert_one_error_line(rc, err, "nvidia-smi")
    assert not (tmp_path / "docker.json").exists()


def test_compose_mode_missing_runtime(tmp_path: Path, fake_docker: dict[str, str]) -> None:
    rc, _, err = run_script(env={**fake_docker, "LLM_DEVICE": "hpu"})
    assert_one_error_line(rc, err, "LLM_DEVICE=hpu", "hl-smi")
    assert not (tmp_path / "docker.json").exists()


def test_compose_flag_without_engine(tmp_path: Path) -> None:
    env = base_env(tmp_path, PATH=path_without(tmp_path))
    rc, _, err = run_script("--compose", env=env)
    assert_one_error_line(rc, err, "--compose")


# ------------------------------------------------------------------------ native, end to end


class Stack:
    """./run_server.sh --native in the background; stdout collected by a thread."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.ms_url = f"http://127.0.0.1:{env['LLM_MODEL_SERVER_PORT']}"
        self.usvc_url = f"http://127.0.0.1:{env['LLM_USVC_PORT']}"
        self.proc = subprocess.Popen(
            [str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, o=sink: o.extend(s), daemon=True).start()

    def logs(self) -> str:
        text = "".join(self.out) + "".join(self.err)
        for log in sorted(Path(self.env["WICK_LOG_DIR"]).glob("*.log")):
            text += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
        return text

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any("Press Ctrl-C" in line for line in self.out):
            assert self.proc.poll() is None, f"run_server.sh exited early:\n{self.logs()}"
            assert time.monotonic() < deadline, f"not ready:\n{self.logs()}"
            time.sleep(0.5)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.e2e
@pytest.mark.slow
def test_native_stack_on_cpu(tmp_path: Path) -> None:
    # No configuration beyond free ports and a small KV cache (the box is shared).
    env = base_env(tmp_path, LLM_KV_CACHE_MEMORY="256MiB", LLM_MAX_MODEL_LEN="2048")
    stack = Stack(env)
    try:
        stack.wait_ready()
        banner = "".join(stack.out)
        assert f"http://localhost:{env['LLM_USVC_PORT']}" in banner and "curl" in banner
        # The chat page is linked, and is there.
        page = f"http://localhost:{env['LLM_MODEL_SERVER_PORT']}/"
        assert f"chat page     {page}" in banner
        assert "<title>Wick chat</title>" in httpx.get(page, timeout=30).text

        # The seed's health check.
        health = httpx.get(f"{stack.usvc_url}/v1/health_check", timeout=30)
        assert health.status_code == 200, health.text
        assert "Service Title" in health.json()
        assert httpx.get(f"{stack.ms_url}/health", timeout=30).status_code == 200

        # The seed's non-streaming chat payload.
        payload = {
            "messages": {"system": SEED_SYSTEM, "user": "### Question: Who are you? \n\n"},
            "max_new_tokens": 17, "top_p": 0.95, "temperature": 0.01, "streaming": False,
        }  # fmt: skip
        answer = httpx.post(f"{stack.usvc_url}/v1/chat/completions", json=payload, timeout=120)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["text"].strip() and body["streaming"] is False
        assert body["prompt"] == payload["messages"]["user"]

        # The seed's streaming payload: `data: '<piece>'` lines, then [DONE].
        question = {"system": SEED_SYSTEM, "user": "What is Deep Learning?"}
        payload |= {"streaming": True, "max_new_tokens": 8, "messages": question}
        with httpx.stream(
            "POST", f"{stack.usvc_url}/v1/chat/completions", json=payload, timeout=120
        ) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = [line for line in stream.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert len(events) >= 2 and all(e.startswith("data: '") for e in events[:-1])

        # promtool on real scrapes of both services, after that traffic.
        for url in (stack.ms_url, stack.usvc_url):
            scrape = httpx.get(f"{url}/metrics", timeout=30)
            assert scrape.status_code == 200
            assert promtool_check_metrics(scrape.content) == [], url
    except BaseException:
        stack.stop()
        raise
    code = stack.stop()
    assert code == 0, stack.logs()
    assert any("stopped" in line for line in stack.err)
    for port in (env["LLM_MODEL_SERVER_PORT"], env["LLM_USVC_PORT"]):
        assert port_free(int(port)), f"port {port} still in use"
    for url in (stack.ms_url, stack.usvc_url):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    # The services' logs went to WICK_LOG_DIR.
    logs = {p.name for p in Path(env["WICK_LOG_DIR"]).iterdir()}
    assert logs == {"model-server.log", "microservice.log"}
    assert os.path.getsize(Path(env["WICK_LOG_DIR"]) / "model-server.log") > 0


def test_compose_mode_adds_the_rag_profile_for_a_rag_model(
    tmp_path: Path, fake_docker: dict[str, str]
) -> None:
    env = {**fake_docker, "LLM_EMBEDDING_MODEL": "BAAI/bge-small-en-v1.5"}
    Path(env["WICK_ENV_FILE"]).write_text("LLM_DEVICE=cpu\n")
    rc, _, err = run_script("-d", env=env)
    assert rc == 0, err
    record = json.loads((tmp_path / "docker.json").read_text())
    assert record["argv"][-6:] == ["--profile", "cpu", "--profile", "rag", "up", "-d"]
    assert record["profiles"] == "cpu,rag"


@pytest.mark.e2e
@pytest.mark.slow
def test_native_stack_with_the_rag_models(tmp_path: Path) -> None:
    """LLM_EMBEDDING_MODEL and LLM_RERANK_MODEL: two more model servers and the OPEA embedding
    and reranking microservices, ready before the banner, stopped with the rest."""
    from tests.engine.pooling.conftest import minilm_path, write_tiny_cross_encoder

    reranker = write_tiny_cross_encoder(tmp_path / "reranker")
    ports = {
        name: str(free_port())
        for name in ("LLM_EMBEDDING_MODEL_SERVER_PORT", "EMBEDDING_USVC_PORT",
                     "LLM_RERANK_MODEL_SERVER_PORT", "RERANKING_USVC_PORT")
    }  # fmt: skip
    env = base_env(
        tmp_path, LLM_KV_CACHE_MEMORY="128MiB", LLM_MAX_MODEL_LEN="1024",
        LLM_EMBEDDING_MODEL=minilm_path(), LLM_RERANK_MODEL=str(reranker), **ports,
    )  # fmt: skip
    stack = Stack(env)
    try:
        stack.wait_ready()
        banner = "".join(stack.out)
        embed_url = f"http://127.0.0.1:{ports['EMBEDDING_USVC_PORT']}"
        rerank_url = f"http://127.0.0.1:{ports['RERANKING_USVC_PORT']}"
        assert f"localhost:{ports['EMBEDDING_USVC_PORT']}/v1/embeddings" in banner
        doc = httpx.post(f"{embed_url}/v1/embeddings", json={"text": "hi"}, timeout=60).json()
        assert len(doc["embedding"]) == 384
        body = {"input": "q", "retrieved_docs": ["a", "b"], "top_n": 2}
        reranked = httpx.post(f"{rerank_url}/v1/reranking", json=body, timeout=60).json()
        assert sorted(d["text"] for d in reranked["reranked_docs"]) == ["a", "b"]
        # The RAG model servers did not take the LLM's settings (LLM_MAX_MODEL_LEN=1024 would
        # be refused by MiniLM, whose maximum is 256).
        models = httpx.get(f"http://127.0.0.1:{ports['LLM_EMBEDDING_MODEL_SERVER_PORT']}/v1/models")
        assert models.json()["data"][0]["max_model_len"] == 256
    except BaseException:
        stack.stop()
        raise
    code = stack.stop()
    assert code == 0, stack.logs()
    for port in ports.values():
        assert port_free(int(port)), f"port {port} still in use"
    logs = {p.name for p in Path(env["WICK_LOG_DIR"]).iterdir()}
    assert {"embedding-model-server.log", "reranking-microservice.log"} <= logs
