"""candle-vllm's clients as its README spells them, against the real server on a loopback port.

The README's curl (`"model": "llama7b"`, `"stop": {"Single": "</s>"}`), its openai-package
sample (`model="llama"`) and its batched sample (`model = "mistral7b"`) run verbatim but for the
port (candle's 2000 -> the test server's) against a server started with
`--accept-any-model-name`; without the flag the same curl gets vLLM's 404. Its chat client's
`chat.py --live` is Wick's examples/chat.py driven through a pseudo-terminal.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import ServerProcess, launch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CANDLE_PORT = "2000"

# candle-vllm's README, "Option 2: Chat completion request with HTTP post".
README_CURL = """curl -X POST "http://127.0.0.1:2000/v1/chat/completions" \\
     -H "Content-Type: application/json" \\
     -H "Authorization: Bearer YOUR_API_KEY" \\
     -d '{
           "model": "llama7b",
           "messages": [
               {"role": "user", "content": "Explain how to best learn Rust."}
           ],
           "temperature": 0.7,
          "max_tokens": 128,
          "stop": {"Single":"</s>"}
       }'
"""

# "Option 3: Chat completion with with openai package".
README_OPENAI = """import openai

openai.api_key = "EMPTY"

openai.base_url = "http://localhost:2000/v1/"

completion = openai.chat.completions.create(
    model="llama",
    messages=[
        {
            "role": "user",
            "content": "Explain how to best learn Rust.",
        },
    ],
    max_tokens = 64,
)
print(completion.choices[0].message.content)
"""

# "Batched requests": the README shows `benchmark()`; the two helpers it calls (from candle's
# examples/benchmark.py) are written here: a streaming chat request each, and its text.
BENCHMARK_HEAD = """import asyncio
from typing import List

import openai
from openai import Stream
from openai.types.chat import ChatCompletionChunk

openai.api_key = "EMPTY"
openai.base_url = "http://localhost:2000/v1/"


async def chat_completion(model, max_tokens, prompt):
    return openai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
    )


async def stream_response(response_idx, stream):
    result = ""
    for chunk in stream:
        result += chunk.choices[0].delta.content or ""
    return (response_idx, result)

"""


def readme_benchmark() -> str:
    """The README's `benchmark()` verbatim, from the seed README kept beside the test."""
    text = (Path(__file__).with_name("candle_vllm_benchmark.py.txt")).read_text()
    # 16 answers of up to 1024 tokens take minutes on a CPU: only their length is cut.
    return text.replace("max_tokens = 1024", "max_tokens = 24")


def on_port(text: str, server: ServerProcess) -> str:
    assert f":{CANDLE_PORT}/" in text
    return text.replace(f":{CANDLE_PORT}/", f":{server.port}/")


def client_env() -> dict[str, str]:
    # A proxy in the environment must not catch loopback requests.
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return {**env, "NO_PROXY": "*"}


@pytest.fixture(scope="module")
def any_name_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = launch(tmp_path_factory.mktemp("any-name"), "--accept-any-model-name")
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]


def run_curl(server: ServerProcess) -> dict:
    proc = subprocess.run(
        ["bash", "-c", on_port(README_CURL, server)],
        capture_output=True,
        text=True,
        timeout=300,
        env=client_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_readme_curl_is_answered_with_accept_any_model_name(
    any_name_server: ServerProcess, model_name: str
) -> None:
    body = run_curl(any_name_server)
    assert "error" not in body, body
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].strip()
    assert "</s>" not in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 128
    assert body["model"] == model_name  # the served name, not "llama7b"
    assert "'llama7b' is not a served name" in any_name_server.log()


def test_readme_curl_without_the_flag_is_vllms_404(server: ServerProcess) -> None:
    error = run_curl(server)["error"]
    assert error["code"] == "model_not_found"
    assert "`llama7b` does not exist" in error["message"]
    assert "--accept-any-model-name" in error["message"]


def run_python(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "sample.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=client_env(),
    )


def test_readme_openai_sample(any_name_server: ServerProcess, tmp_path: Path) -> None:
    proc = run_python(on_port(README_OPENAI, any_name_server), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_readme_batched_sample(any_name_server: ServerProcess, tmp_path: Path) -> None:
    source = on_port(BENCHMARK_HEAD, any_name_server) + readme_benchmark()
    assert 'model = "mistral7b"' in source
    proc = run_python(source, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = proc.stdout.split(" Response ")[1:]
    assert [a.split(":")[0] for a in answers] == [str(i) for i in range(16)]
    assert all(a.split(":", 1)[1].strip() for a in answers), proc.stdout


# ------------------------------------------------------------------------------ chat.py


def drive_chat(*args: str, turns: list[str], timeout: float = 180) -> tuple[int, str]:
    """Run examples/chat.py on a pseudo-terminal: send each turn once the previous reply's
    statistics line (`... tok/s`) is on the screen, then /exit. Returns (exit code, output)."""
    main, child = pty.openpty()
    env = {**client_env(), "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "chat.py"), *args],
        stdin=child,
        stdout=child,
        stderr=child,
        env=env,
        close_fds=True,
    )
    os.close(child)
    out = b""
    deadline = time.monotonic() + timeout
    pending = [*turns, "/exit"]
    replies = 0
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            prompts = out.count(b"You:")
            # A turn goes in when its prompt is shown; /exit after the last reply's stats.
            if pending and prompts > replies and (replies == 0 or out.count(b"tok/s") >= replies):
                os.write(main, pending.pop(0).encode() + b"\r")
                replies += 1
            if proc.poll() is not None and not ready:
                break
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    return code, out.decode(errors="replace")


# Rich's Live display hides the cursor and, to redraw, erases the lines it drew.
HIDE_CURSOR, ERASE_LINE = "\x1b[?25l", "\x1b[2K"
QUESTION = "What is the capital of France?"


def test_chat_live_on_a_terminal(server: ServerProcess) -> None:
    """candle-vllm's `chat.py --live`, with docs/deployment.md's base URL (`.../v1`): the reply
    is rendered as Markdown redrawn in place while it streams."""
    code, out = drive_chat(
        "--base-url", f"{server.url}/v1", "--live", "--temperature", "0", "--max-tokens", "24",
        turns=[QUESTION],
    )  # fmt: skip
    assert code == 0, out[-3000:]
    assert "Paris" in out, out[-3000:]
    assert HIDE_CURSOR in out and ERASE_LINE in out, out[-3000:]
    assert "tok/s" in out


def test_chat_without_live_streams_plain_text(server: ServerProcess) -> None:
    code, out = drive_chat(
        "--base-url", server.url, "--temperature", "0", "--max-tokens", "24", turns=[QUESTION]
    )
    assert code == 0, out[-3000:]
    assert "Paris" in out, out[-3000:]
    assert HIDE_CURSOR not in out and ERASE_LINE not in out, out[-3000:]
