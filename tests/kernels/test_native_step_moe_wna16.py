"""The native decoder step on mixture-of-experts models whose experts stay GPTQ / AWQ codes
(kernels/cpu/moe_wna16.c, the same function the CPU table's `fused_experts` runs under the
modules): tiny random Mixtral and Qwen3-MoE models that transformers writes, quantized by
`wick quantize`'s writer (4 bits, group 32), generate the same greedy tokens and top logprobs
with the step as without it (the modules), in fp32 and bf16, with prefill chunks mixed with
decodes (tests/kernels/test_native_step_families.py's pattern)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_server.kernels.cpu import linear_tuning
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import NATIVE as NATIVE_GEMM
from model_server.kernels.cpu.linear_tuning import WNA16_NATIVE
from model_server.sampling_params import SamplingParams
from tests.kernels.test_native_step_families import (
    NATIVE,
    _engine,
    _folder,
    _with_and_without_the_step,
)

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)


def _force_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer replaced (tests/kernels/helpers.py's `force`, two winners): the projections'
    codes on the native wNa16 kernel, the float routers on the native skinny matmul, so every
    matmul of the stack has a native kernel whatever tiny shapes would time."""

    def fake(calls, pair_budget_s=0.0):
        times = {}
        for name, call in calls.items():
            try:
                call()
            except Exception:
                continue
            times[name] = 1.0 if name in (WNA16_NATIVE, NATIVE_GEMM) else 2.0
        return times

    monkeypatch.setattr(linear_tuning, "time_candidates", fake)


@pytest.mark.parametrize(
    ("family", "method", "dtype"),
    [
        ("mixtral", "gptq", "float32"),
        ("mixtral", "gptq", "bfloat16"),
        ("qwen3-moe", "gptq", "float32"),
        ("qwen3-moe", "gptq", "bfloat16"),
        ("qwen3-moe", "awq", "bfloat16"),
    ],
)
def test_the_native_step_runs_quantized_experts_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str, method: str, dtype: str
) -> None:
    from model_server.layers.quantization.wna16_moe import WNA16Experts
    from model_server.loader.load import load_model_source
    from model_server.loader.write_quantized import write_quantized_folder

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    _force_native(monkeypatch)
    folder = _folder(tmp_path / "model", NATIVE[family])
    quantized = write_quantized_folder(
        load_model_source(str(folder)), tmp_path / "q", method, 4, 32, sym=method == "gptq"
    )
    llm = _engine(quantized, dtype)
    runner = llm.engine.core.model_runner
    assert runner.native_step is not None, runner.prepared.native_reason
    assert runner.prepared.quantization_description.startswith(method)
    layers = runner.native_step.layers
    assert all(isinstance(layer.moe.w13, WNA16Experts) for layer in layers)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 8 for tokens, _ in native)
