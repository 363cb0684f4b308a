"""`bench serve`'s default tokenizer: the served model's, read from the server's /v1/models
(`root`: the server's --model) when that is a folder or file on this machine; otherwise the
embedded SmolLM2's (or random words without it), saying why; `--tokenizer none` keeps random
words. Against a real `serve` on a loopback port with a tiny model whose word-level tokenizer is
not SmolLM2's, and against the fake server (whose card names no path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_server.benchmarks.serve import default_tokenizer, run_serve_benchmark
from model_server.entrypoints.cli import build_parser
from tests.benchmarks.test_bench_vllm_gcu import _server
from tests.entrypoints.conftest import TINY_CONFIG
from tests.fake_openai_server import FakeOpenAI, serve

WORDS = [f"w{i}" for i in range(200)]


def _word_level_model(folder: Path) -> Path:
    """A tiny dummy-weight Llama whose tokenizer maps each of WORDS to one id (no BOS added)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    folder.mkdir()
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": len(vocab)}))
    return folder


def _bench(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_server", "bench", "serve", "--base-url", url,
         "--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "2",
         "--ignore-eos", "--keep-special-tokens", "--disable-tqdm", "--save-result", str(out),
         *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
def test_default_is_the_served_models_tokenizer(tmp_path: Path) -> None:
    folder = _word_level_model(tmp_path / "word-llama")
    with _server(folder, "--served-model-name", "word-llama") as url:
        proc = _bench(url, tmp_path / "served.json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"tokenizer: {folder} (the served model's)" in proc.stdout
    served = json.loads((tmp_path / "served.json").read_text())
    # The server counts exactly the prompt tokens the bench built with the served tokenizer
    # (SmolLM2's token text would split into other counts of this vocabulary's words).
    assert served["model_id"] == "word-llama"
    assert served["tokenizer_id"] == str(folder)
    assert served["total_input_tokens"] == 3 * 12
    assert served["completed"] == 3


def _args(url: str, *extra: str):
    return build_parser().parse_args(["bench", "serve", "--base-url", url, *extra])


def test_a_served_name_that_is_no_local_path_falls_back(capsys) -> None:
    from model_server.benchmarks.random_prompts import load_tokenizer

    _, embedded = load_tokenizer(None)  # SmolLM2's path, or random words without its package
    flags = ("--num-prompts", "1", "--random-output-len", "2", "--disable-tqdm")
    with serve(FakeOpenAI()) as url:  # its card: id "fake-model", no root
        assert run_serve_benchmark(_args(url, *flags)) == 0
        printed = capsys.readouterr().out
        assert (
            f"tokenizer: {embedded} (the served model: fake-model is no folder or file on this "
            "machine)" in printed
        )
        assert run_serve_benchmark(_args(url, *flags, "--tokenizer", "none")) == 0
        assert "tokenizer: none (random words)\n" in capsys.readouterr().out


def test_default_tokenizer_order(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    assert default_tokenizer(_args("http://x", "--tokenizer", "none"), str(folder)) == "none"
    assert default_tokenizer(_args("http://x", "--model", str(folder)), "other") == str(folder)
    assert default_tokenizer(_args("http://x", "--model", "name"), str(folder)) == str(folder)
    assert default_tokenizer(_args("http://x"), "org/hub-id") is None
    assert default_tokenizer(_args("http://x"), None) is None
