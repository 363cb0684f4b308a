"""examples/chat.py driven through stdin against the fake OpenAI server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fake_openai_server import FakeOpenAI, serve

CHAT = Path(__file__).resolve().parents[2] / "examples" / "chat.py"


def _chat(url: str, stdin: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHAT), "--base-url", url, *flags],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "120"},
    )


def test_chat_keeps_history_and_resets() -> None:
    fake = FakeOpenAI()
    with serve(fake) as url:
        proc = _chat(
            url, "hello there\nsecond\n/reset\nthird\n/exit\nnever sent\n", "--system", "Be brief."
        )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Chatting with fake-model" in out
    assert "you said: hello there" in out
    assert "you said: second" in out
    assert "you said: third" in out
    assert "never sent" not in out
    assert len(fake.requests) == 3
    system = {"role": "system", "content": "Be brief."}
    assert fake.requests[1]["messages"] == [
        system,
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "you said: hello there"},
        {"role": "user", "content": "second"},
    ]
    # After /reset only the system prompt and the new question are sent.
    assert fake.requests[2]["messages"] == [system, {"role": "user", "content": "third"}]
    first = fake.requests[0]
    assert first["model"] == "fake-model" and first["stream"] is True
    assert (first["max_tokens"], first["temperature"]) == (512, 0.7)


def test_chat_error_turn_is_dropped_from_history() -> None:
    fake = FakeOpenAI(fail_every=1)
    with serve(fake) as url:
        proc = _chat(url, "hi\n", "--model", "m", "--max-tokens", "7", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr  # EOF ends the chat
    assert "error:" in proc.stdout and "boom" in proc.stdout
    assert fake.requests[0]["max_tokens"] == 7
    assert fake.requests[0]["temperature"] == 0.0


def test_chat_unreachable_server() -> None:
    proc = _chat("http://127.0.0.1:9", "")
    assert proc.returncode == 1
    assert "cannot reach" in proc.stdout


def test_chat_takes_the_base_url_with_or_without_v1() -> None:
    """docs/deployment.md's `--base-url http://localhost:8008/v1` (the openai SDK's spelling)
    requested /v1/v1/models; both spellings now reach /v1/..."""
    fake = FakeOpenAI()
    with serve(fake) as url:
        procs = [_chat(base, "hi\n") for base in (f"{url}/v1", f"{url}/v1/", url)]
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
        assert "cannot reach" not in proc.stdout
        assert "you said: hi" in proc.stdout
    assert len(fake.requests) == 3


def test_chat_live_piped_stays_plain_text() -> None:
    """candle-vllm's `chat.py --live` is accepted; with nothing to redraw (a pipe) the reply is
    the plain text, with no terminal control sequences."""
    fake = FakeOpenAI()
    with serve(fake) as url:
        proc = _chat(url, "hello\n", "--live")
    assert proc.returncode == 0, proc.stderr
    assert "you said: hello" in proc.stdout
    assert "\x1b[" not in proc.stdout
