"""The in-process server over a real tensor-parallel engine (TP=2 on gloo: rank 0 here, rank 1 a
worker process): it serves, and when the worker dies `/health` turns 503 with the reason
within seconds and requests fail instead of hanging (in-process there is no uvicorn to exit, so
the 503 stays observable)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.entrypoints.conftest import MODEL_NAME, start_app, tiny_settings

pytestmark = pytest.mark.slow


def test_worker_death_turns_health_503_and_fails_requests(tiny_config: Path) -> None:
    client = start_app(tiny_settings(tiny_config, tensor_parallel_size=2))
    try:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert client.get("/health").status_code == 200

        (worker,) = client.app.state.engine_client._engine.core.executor.workers
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 five seconds after the kill"
            time.sleep(0.05)
        assert health.status_code == 503
        assert health.json()["phase"] == "error"
        assert "tensor-parallel worker" in health.json()["message"]

        start = time.monotonic()
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code >= 500 and "tensor-parallel worker" in resp.text
        assert time.monotonic() - start < 5
    finally:
        client.close()
