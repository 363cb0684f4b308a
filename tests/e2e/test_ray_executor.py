"""`--distributed-executor-backend ray` through the real command line: a local Ray cluster (`ray
start --head`, this test's own), the worker rank as a Ray actor in a placement group, and the
same greedy text as tensor parallelism over processes (mp); the refusals are one clear line."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TP_GENERATE, launch
from tests.loopback import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
# The same ranks' split as over processes (test_tensor_parallel.py), in float32 (see there).
GENERATE = (*TP_GENERATE, "--tensor-parallel-size", "2")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_", "RAY_"))}
    return subprocess.run(
        [sys.executable, "-m", "model_server", *args],
        capture_output=True,
        text=True,
        timeout=400,
        env={**base, **env},
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster of this test's own (`--block`: SIGTERM stops what it started)."""
    port = free_port()
    # Short: Ray's unix sockets live under it (108 bytes at most).
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray = Path(sys.executable).parent / "ray"
    head = subprocess.Popen(
        [str(ray), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
         "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        assert head.stdout is not None
        for line in head.stdout:
            if "will now block" in line:
                break
            assert time.monotonic() < deadline, "ray start did not come up"
        else:
            raise AssertionError(f"ray start exited with {head.wait()}")
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_ranks_generate_the_same_text_as_mp(ray_address: str, tp1_text: str) -> None:
    """mp's ranks print one process's text (test_tensor_parallel.py asserts it against the same
    session fixture): Ray's must too."""
    on_ray = _cli(*GENERATE, "--distributed-executor-backend", "ray", RAY_ADDRESS=ray_address)
    assert on_ray.returncode == 0, on_ray.stderr
    assert "Connecting to existing Ray cluster at address: " in on_ray.stderr
    assert on_ray.stdout == tp1_text


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("generate", "--prompt", "x", "--distributed-executor-backend", "ray"),
         "it needs --tensor-parallel-size 2 or more"),
        (("worker", "-tp", "2", "--distributed-executor-backend", "ray"),
         "Ray starts every rank: no `worker` nodes"),
        (("generate", "--prompt", "x", "--distributed-executor-backend", "slurm"),
         "invalid choice: 'slurm'"),
    ],
)  # fmt: skip
def test_what_ray_cannot_do_is_refused(args: tuple[str, ...], needle: str) -> None:
    proc = _cli(*args, NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert proc.returncode != 0
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_dead_rank_actor_fails_the_server(
    ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a dead mp worker: /health turns 503 (or the server is gone) within seconds, and the
    server exits non-zero for its supervisor to restart it."""
    monkeypatch.setenv("RAY_ADDRESS", ray_address)
    server = launch(
        tmp_path, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--skip-warmup", "--log-level", "info",
    )  # fmt: skip
    try:
        server.wait_ready()
        # Ray forwards the actor's log lines to the driver, prefixed with its pid.
        deadline = time.monotonic() + 30
        while (match := re.search(r"\(_Rank pid=(\d+)", server.log())) is None:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        os.kill(int(match.group(1)), signal.SIGKILL)
        killed_at = time.monotonic()
        status: int | str = 200
        while time.monotonic() - killed_at < 15 and status == 200:
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = "down"
            time.sleep(0.1)
        assert status in (503, "down"), status
        assert server.proc.wait(60) != 0
        assert "tensor-parallel rank 1 (a Ray actor) failed" in server.log()
    finally:
        server.stop()
