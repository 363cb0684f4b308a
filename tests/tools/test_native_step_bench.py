"""`python -m tools.native_step_bench` runs end to end on a tiny random Phi-2 (no timing is
asserted): both paths decode, the step takes every row count, and their tokens agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from model_server.kernels.cpu.gemm import default_kernels
from tools import native_step_bench

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)


def test_both_paths_decode_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.PhiConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=256,
        max_position_embeddings=256,
        partial_rotary_factor=0.5,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "phi2")
    threads = torch.get_num_threads()
    try:
        argv = [str(tmp_path / "phi2"), "--dtype", "float32", "--threads", "1", "--rounds", "1"]
        assert native_step_bench.main([*argv, "--output-len", "4", "--pin-panels"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "load average: " in out
    assert "native step: one native call per step at 1-64 rows" in out
    assert "modules / native: " in out and "same tokens: True" in out
    assert out.count("ms/token median") == 2
