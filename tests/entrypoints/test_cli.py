"""`python -m model_server generate` as a user runs it: text on stdout, logs on stderr."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_server", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_generate_prints_only_the_text() -> None:
    proc = run_cli(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--log-level",
        "INFO",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "INFO" not in proc.stdout and "INFO" in proc.stderr  # logs stay on stderr
    assert proc.stdout.count("\n") <= 3


def test_generate_missing_model_is_one_clear_error(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    proc = run_cli("generate", "--prompt", "hi", "--model", str(missing))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert str(missing) in proc.stderr


def test_help_documents_engine_flags() -> None:
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    for flag in ("--max-num-seqs", "--kv-cache-memory", "--enable-prefix-caching", "--model"):
        assert flag in proc.stdout


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--kv-cache-memory", "8192"), "8192MiB"),  # no unit: refused, not 8192 bytes
        (("--kv-cache-memory", "100KiB"), "raise --kv-cache-memory"),  # under 2 blocks
        (("--max-model-len", "99999999"), "max_position_embeddings"),  # was an OOM kill
        (("--attention-backend", "triton"), "need a CUDA or GCU device"),  # was a traceback
        (("--block-size", "7"), "power of two"),
        # Served on one device, silently: each rank takes one id.
        (("--device-ids", "0,1"), "add -tp 2"),
    ],
)
def test_serve_misconfiguration_exits_with_one_error_line(
    flags: tuple[str, ...], needle: str
) -> None:
    """A start that cannot work ends with exit code 1 (not a signal) and one error line that
    says why: no traceback, no second line repeating it."""
    from tests.loopback import free_port

    # The suite sets TRITON_INTERPRET=1 for the kernel tests; a user's shell does not.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_cli(
        "serve", "--port", str(free_port()), "--log-level", "warning", "--skip-warmup", *flags,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [
        line for line in proc.stderr.splitlines() if " ERROR " in line or line.startswith("error:")
    ]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]


def test_generate_with_more_device_ids_than_ranks_is_one_error_line() -> None:
    proc = run_cli("generate", "--prompt", "hi", "--device-ids", "0,1,2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --device-ids 0,1,2 names 3 devices") and "add -tp 3" in line
