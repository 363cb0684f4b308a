"""vLLM-GCU's benchmark lines (`vllm_utils.benchmark_throughput --input-len --output-len`,
`benchmark_serving --backend vllm --dataset-name random ... --ignore_eos --strict-in-out-len
--keep-special-tokens`) as `./wick bench throughput` and `./wick bench serve`, each run for real
on a tiny dummy model (bench serve against a real `serve` on a loopback port)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from model_server.benchmarks.serve import extra_fields
from model_server.entrypoints.cli import build_parser, main
from tests.benchmarks.test_bench_throughput import TINY
from tests.entrypoints.conftest import TINY_CONFIG
from tests.loopback import free_port

pytestmark = pytest.mark.slow


def test_bench_throughput_input_len_output_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`benchmark_throughput --model=DIR --tensor-parallel-size=1 --max-model-len=... --output-len
    --demo=te`, with --input-len (its README's table), every prompt and output fixed."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    argv = ["bench", "throughput", f"--model={path}", "--load-format", "dummy",
            "--tensor-parallel-size=1", "--max-model-len=128", "--num-prompts", "3",
            "--input-len", "12", "--output-len=5", "--demo=te", "--num-threads", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "workload: 3 requests, 36 input tokens, 15 output tokens" in out
    assert "output tok/s" in out


def test_bench_throughput_rejects_a_zero_length() -> None:
    from model_server.benchmarks.throughput import make_workload

    args = build_parser("bench").parse_args(["bench", "throughput", "--input-len", "0"])
    with pytest.raises(ValueError, match="at least 1"):
        make_workload(args, 256)


def test_strict_and_keep_special_tokens_fields() -> None:
    args = build_parser("bench").parse_args(
        ["bench", "serve", "--strict-in-out-len", "--keep-special-tokens", "--ignore_eos"]
    )
    assert args.ignore_eos and args.backend == "vllm" and args.dataset_name == "random"
    assert extra_fields(args, 7) == {"min_tokens": 7, "skip_special_tokens": False}


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--backend", "tgi"], "invalid choice: 'tgi'"),
        (["--dataset-name", "sharegpt"], "invalid choice: 'sharegpt'"),
    ],
)
def test_unsupported_backend_or_dataset_is_refused(flags: list[str], needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "model_server", "bench", "serve", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and needle in proc.stderr


def _hf_folder(folder: Path) -> Path:
    """A tiny Llama config with the embedded model's tokenizer saved beside it (for the bench's
    --model DIR, whose tokenizer it loads as vLLM's does); weights are dummy."""
    from model_server.loader.embedded import embedded_model_available, embedded_model_path
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 (its tokenizer) is not installed")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    tokenizer = gguf_tokenizer(read_gguf(embedded_model_path()))
    assert tokenizer is not None
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def _server(folder: Path, *extra: str) -> Iterator[str]:
    """`./wick serve --model DIR` as vLLM-GCU's api_server line (plus `extra` flags), on a free
    loopback port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "model_server", "serve", "--model", str(folder),
         "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--skip-warmup",
         "--disable-log-requests", "--block-size=16", "--trust-remote-code", "--num-threads", "1",
         *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_bench_serve_with_the_vllm_gcu_flags_against_a_real_server(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path / "tiny-llama")
    result = tmp_path / "result.json"
    with _server(folder) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "model_server", "bench", "serve", "--base-url", url,
             "--backend", "vllm", "--dataset-name", "random", "--model", str(folder),
             "--num-prompts", "2", "--random-input-len", "16", "--random-output-len", "6",
             "--trust-remote-code", "--ignore_eos", "--strict-in-out-len",
             "--keep-special-tokens", "--save-result", str(result)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"tokenizer: {folder}" in proc.stdout  # --model DIR's tokenizer, as vLLM's
    summary = json.loads(result.read_text())
    assert summary["completed"] == 2
    assert summary["total_output_tokens"] == 12  # exact: ignore_eos and min_tokens
