"""Tensor parallelism and platforms through the real command line, with the embedded SmolLM2
(9 query heads, 3 KV heads: rank 0 holds 2 KV-head groups, rank 1 one).

  - `generate --tensor-parallel-size 2` prints the same 32 greedy tokens as without.
  - `--device gcu` / `--device hpu` without their runtimes, and an impossible split, exit
    non-zero with one clear stderr line and no traceback.
  - `serve --tensor-parallel-size 2`: killing the worker turns /health to 503 within seconds,
    fails the request in flight instead of hanging, and the server exits non-zero; SIGTERM stops
    server and worker with no orphan left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TP_GENERATE, ServerProcess, free_port, launch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).parents[2]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    return subprocess.run(
        [sys.executable, "-m", "model_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _worker_pid(server: ServerProcess) -> int:
    workers = [
        pid
        for pid in _children(server.proc.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()  # not resource_tracker
    ]
    assert len(workers) == 1, workers
    return workers[0]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


# As on node 0: every node is given the same engine flags.
WORKER_ARGS = ("--tensor-parallel-size", "2", "--dtype", "float32")


def test_generate_tp2_prints_the_same_text_as_tp1(tp1_text: str) -> None:
    sharded = _cli(*TP_GENERATE, "--tensor-parallel-size", "2")
    assert sharded.returncode == 0, sharded.stderr
    assert sharded.stdout == tp1_text


def test_two_nodes_through_torchrun_style_env(tp1_text: str) -> None:
    """Node 1 (`worker`) and node 0 (`generate`) as two local "nodes", one rank each."""
    rdzv = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
    worker = subprocess.Popen(
        [sys.executable, "-m", "model_server", "worker", *WORKER_ARGS],
        env={**env, **rdzv, "NODE_RANK": "1"},
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node0 = subprocess.run(
            [sys.executable, "-m", "model_server", *TP_GENERATE, "--tensor-parallel-size", "2"],
            env={**env, **rdzv, "NODE_RANK": "0"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert node0.returncode == 0, node0.stderr
        assert node0.stdout == tp1_text
        assert worker.wait(30) == 0, worker.stderr.read() if worker.stderr else ""
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.parametrize(
    ("command", "args", "needle"),
    [
        ("generate", ("--device", "gcu"), "torch_gcu"),
        ("generate", ("--device", "hpu"), "habana_frameworks"),
        ("serve", ("--device", "gcu"), "torch_gcu"),
        ("serve", ("--device", "hpu"), "habana_frameworks"),
        # SmolLM2's 3 KV heads over 4 ranks: checked before any worker starts.
        ("generate", ("--tensor-parallel-size", "4"), "3 KV heads cannot be spread over"),
    ],
)
def test_unusable_device_or_split_is_one_clear_line(
    command: str, args: tuple[str, ...], needle: str
) -> None:
    extra = ("--prompt", "hi", "--max-tokens", "1") if command == "generate" else ("--port", "1")
    result = _cli(command, *args, *extra, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


def test_killing_a_worker_turns_health_to_503_and_fails_requests(tmp_path: Path) -> None:
    server = launch(tmp_path, "--tensor-parallel-size", "2", "--skip-warmup")
    try:
        server.wait_ready()
        worker = _worker_pid(server)
        # A long request in flight when the worker dies must fail, not hang.
        result: dict[str, object] = {}

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
            try:
                with httpx.stream(
                    "POST",
                    f"{server.url}/v1/completions",
                    json={**body, "stream": True},
                    timeout=60,
                ) as resp:
                    result["text"] = "".join(resp.iter_text())
            except httpx.HTTPError as exc:
                result["error"] = exc

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        time.sleep(1.0)
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        status = None
        while time.monotonic() - killed_at < 10:
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = "down"  # the server already exited (engine failure: exit code 1)
            if status != 200:
                break
            time.sleep(0.1)
        assert status in (503, "down"), status
        assert time.monotonic() - killed_at < 10
        thread.join(30)
        assert not thread.is_alive(), "the in-flight request hung"
        assert "error" in result or "error" in str(result.get("text", "")), result
        assert server.proc.wait(60) != 0
    finally:
        server.stop()


def test_sigterm_stops_server_and_workers(tmp_path: Path) -> None:
    server = launch(tmp_path, "--tensor-parallel-size", "2", "--skip-warmup")
    try:
        server.wait_ready()
        worker = _worker_pid(server)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert _wait_gone(worker, 15), "worker outlived the server"


def test_worker_exits_when_the_server_is_killed(tmp_path: Path) -> None:
    server = launch(tmp_path, "--tensor-parallel-size", "2", "--skip-warmup")
    try:
        server.wait_ready()
        worker = _worker_pid(server)
        server.proc.kill()  # no shutdown path runs at all
        server.proc.wait(30)
        assert _wait_gone(worker, 15), "orphaned worker"
    finally:
        server.stop()
