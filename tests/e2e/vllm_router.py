"""vLLM's router (`vllm-router`, the Rust binary of the PyPI wheel) on a free loopback port, in
front of real Wick model servers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.e2e.conftest import ServerProcess, launch
from tests.loopback import free_port

# Small replicas: three of them share two cores and the KV cache is a few MiB each.
REPLICA_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "48MiB", "--num-threads", "1")


def router_binary() -> Path:
    """The console script the `vllm-router` wheel installs next to this interpreter."""
    path = Path(sys.executable).parent / "vllm-router"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: pip install the test extra (vllm-router)")
    return path


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        # The router colours its log lines; the escapes are noise in an assertion message.
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def wait_ready(self, timeout: float = 120) -> None:
        """Until the router answers /v1/models (it waits for its workers' health first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vllm-router not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_router(
    log_dir: Path, workers: list[str], *args: str, env: dict[str, str] | None = None
) -> Router:
    port = free_port()
    log_path = log_dir / f"vllm-router-{port}.log"
    cmd = [str(router_binary()), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *workers, "--log-level", "info", *args]
    # Its own Prometheus exporter listens on a port of its own (29000 by default): a free one.
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    return Router(proc, port, log_path)


def start_replicas(log_dir: Path, extra: Sequence[Sequence[str]]) -> list[ServerProcess]:
    """One model server per entry of `extra` (its own flags beside REPLICA_ARGS), started
    together (they load in parallel), each waited for."""
    replicas = [launch(log_dir, *REPLICA_ARGS, *flags) for flags in extra]
    try:
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas
