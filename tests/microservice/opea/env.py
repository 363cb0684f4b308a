"""The opea-comps side of the OPEA tests: a venv of its own (opea-comps pins about 100 packages
exactly, older than the test venv's, and would break the model server there), the megaservice
process running in it, and loopback servers for what runs in the test process."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.loopback import free_port

HERE = Path(__file__).parent
REQUIREMENTS = HERE / "requirements.txt"
INSTALL_TIMEOUT_S = 900


def opea_python() -> Path:
    """The python of a venv holding exactly `requirements.txt` (made once, next to the test
    venv; remade when the requirements change)."""
    venv = Path(sys.prefix) / "opea-comps"
    python = venv / "bin" / "python"
    wanted = REQUIREMENTS.read_text()
    stamp = venv / ".wick-requirements"
    with open(Path(sys.prefix) / ".opea-comps.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel sessions wait for one install
        if stamp.exists() and stamp.read_text() == wanted:
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        done = subprocess.run(
            [*install, "-r", str(REQUIREMENTS)],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"installing {wanted.strip()} failed:\n{done.stderr[-4000:]}")
        stamp.write_text(wanted)
    return python


@dataclass
class Megaservice:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def schedule(
        self, graph: str, inputs: dict[str, Any], params: dict[str, Any] | None = None
    ) -> httpx.Response:
        """`ServiceOrchestrator.schedule(inputs, LLMParams(**params))` on `graph`."""
        body = {"graph": graph, "inputs": inputs, "params": params or {}}
        return httpx.post(f"{self.url}/v1/test/schedule", json=body, timeout=180)

    def chatqna(self, body: dict[str, Any]) -> httpx.Response:
        """What a ChatQnA client sends: the gateway's /v1/chatqna."""
        return httpx.post(f"{self.url}/v1/chatqna", json=body, timeout=180)

    def received(self) -> list[str]:
        """The texts the downstream node received since the last call."""
        return httpx.get(f"{self.url}/v1/test/received", timeout=10).json()


def start_megaservice(
    log_dir: Path, graphs: dict[str, dict[str, Any]], corpus: list[dict[str, Any]] | None = None
) -> Megaservice:
    """megaservice.py under the opea-comps venv, ready (its /v1/health_check answers).
    `corpus`: the stand-in retriever's documents, `{"text", "embedding"}`."""
    python = opea_python()
    port = free_port()
    log_path = log_dir / f"megaservice-{port}.log"
    config = json.dumps({"port": port, "graphs": graphs, "corpus": corpus or []})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(python), str(HERE / "megaservice.py"), config],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=HERE,
        )
    service = Megaservice(proc, port, log_path)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"megaservice exited with {proc.returncode}:\n{service.log()}")
        try:
            if httpx.get(f"{service.url}/v1/health_check", timeout=2).status_code == 200:
                return service
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    service.stop()
    raise TimeoutError(f"megaservice not up after 90 s:\n{service.log()}")
