"""SIGTERM on the real `python -m microservice` process: the in-flight stream finishes, new
requests meanwhile get 503 with Retry-After (not a refused connection), then it exits 0. The
model server is the fake OpenAI server on loopback, slowed down so the stream lasts seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fake_openai_server import FakeOpenAI, serve
from tests.loopback import free_port

ROOT = Path(__file__).parents[2]


def test_sigterm_keeps_answering_503_while_the_stream_in_flight_finishes(tmp_path: Path) -> None:
    fake = FakeOpenAI(delay_s=0.25)
    with serve(fake) as upstream:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "VLLM_"))}
        env |= {"LLM_MODEL_SERVER_ENDPOINT": upstream, "LLM_OPENAI_FORMAT_STREAMING": "true"}
        log = (tmp_path / "usvc.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "microservice", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"{url}/v1/health_check", timeout=2)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.1)
            result: dict[str, Any] = {}
            first = threading.Event()

            def in_flight() -> None:
                words = " ".join(f"w{i}" for i in range(16))  # answered back word by word
                body = {"messages": [{"role": "user", "content": words}], "stream": True}
                chat = f"{url}/v1/chat/completions"
                with httpx.stream("POST", chat, json=body, timeout=60) as r:
                    lines = []
                    for line in r.iter_lines():
                        first.set()
                        if line:
                            lines.append(line)
                    result.update(status=r.status_code, lines=lines)

            thread = threading.Thread(target=in_flight)
            thread.start()
            assert first.wait(30)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.headers["connection"] == "close"
            assert refused.json()["error"]["code"] == "shutting_down"
            assert thread.is_alive(), "the stream ended before the checks: slow the fake down"
            thread.join(60)
            assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
