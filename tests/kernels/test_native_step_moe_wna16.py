"""The native decoder step on mixture-of-experts models whose experts stay GPTQ / AWQ codes
(kernels/cpu/moe_wna16.c, the same function the CPU table's `fused_experts` runs under the
modules): tiny random Mixtral and Qwen3-MoE models that transformers writes, quantized by
`wick quantize`'s writer (4 bits, group 32), generate the same greedy tokens and top logprobs
with the step as without it (the modules), in fp32 and bf16, with prefill chunks mixed with
decodes (tests/kernels/test_native_step_families.py's pattern)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import transformers

from model_server.kernels.cpu import linear_tuning
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import NATIVE as NATIVE_GEMM
from model_server.kernels.cpu.linear_tuning import WNA16_NATIVE
from model_server.sampling_params import SamplingParams
from tests.kernels.test_native_step_families import (
    _COMMON,
    NATIVE,
    _engine,
    _folder,
    _QuietWindow,
    _rank0_times_its_own,
    _with_and_without_the_step,
    quantized_folder,
    tp2_native_matches_tp1,
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
        ("mixtral", "gptq-act-order", "bfloat16"),
        ("qwen3-moe", "gptq-act-order", "float32"),
    ],
)
def test_the_native_step_runs_quantized_experts_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str, method: str, dtype: str
) -> None:
    """`gptq-act-order`: every projection's codes (attention's and the experts') stored in a
    pseudo-random order of its input features (`desc_act`), gathered back by the C code."""
    from model_server.layers.quantization.wna16_moe import WNA16Experts

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    _force_native(monkeypatch)
    folder = _folder(tmp_path / "model", NATIVE[family])
    quantized = quantized_folder(folder, tmp_path / "q", method)
    act_order = method.endswith("-act-order")
    method = method.removesuffix("-act-order")
    llm = _engine(quantized, dtype)
    runner = llm.engine.core.model_runner
    assert runner.native_step is not None, runner.prepared.native_reason
    assert runner.prepared.quantization_description.startswith(method)
    layers = runner.native_step.layers
    assert all(isinstance(layer.moe.w13, WNA16Experts) for layer in layers)
    assert all((layer.moe.w13.perm is not None) == act_order for layer in layers)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 8 for tokens, _ in native)


# Under TP=2 each rank holds half of every expert's intermediate dim, in whole groups of 32:
# intermediate sizes of 64 and 128.
TP_MODELS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # a gated shared expert, its own partial sum all-reduced apart
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        norm_topk_prob=False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "method", "dtype"),
    [("qwen3-moe", "gptq", "bfloat16"), ("qwen2-moe", "awq", "float32")],
)
def test_tensor_parallel_ranks_run_quantized_experts_natively(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shared_cache_dir: Path,
    family: str,
    method: str,
    dtype: str,
) -> None:
    """GPTQ / AWQ experts under TP=2: each rank's native step runs its whole groups of every
    expert's codes (gate|up rows, down's input features), the partial sums all-reduced between
    calls. Rank 0 with the step gives rank 0 without it the same bits, and TP=1's greedy
    tokens, its logprobs up to the order of the partial sums."""
    from model_server.layers.quantization.wna16_moe import WNA16Experts

    monkeypatch.setenv("WICK_CACHE_DIR", str(shared_cache_dir))
    _force_native(monkeypatch)
    monkeypatch.setattr(linear_tuning, "LoadWindow", _QuietWindow)
    _rank0_times_its_own(monkeypatch)
    folder = _folder(tmp_path / "model", TP_MODELS[family])
    quantized = quantized_folder(folder, tmp_path / "q", method)
    step = tp2_native_matches_tp1(monkeypatch, quantized, dtype)
    assert isinstance(step.layers[0].moe.w13, WNA16Experts) and step.layers[0].tp_size == 2
