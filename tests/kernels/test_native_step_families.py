"""The runner's native decoder step across the families (kernels/cpu/decoder_stack.c): on each
tiny random model that transformers writes, one engine generates with the step and without it
(the modules), and the greedy tokens and top logprobs are the same bits, in fp32 and bf16, with
prefill chunks mixed with decodes. One engine per case, so one plan: the step is switched on
the runner, never re-planned. Families the step does not run say why in the plan."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.kernels.cpu import decoder_stack
from model_server.kernels.cpu.experts_plan import PanelExperts, plan_experts
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import NATIVE as NATIVE_GEMM
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.kernels.cpu.tuning_cache import TuningCache
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, force

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

WINDOW = 8
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

NATIVE: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32),
    "qwen2-bias": lambda: transformers.Qwen2Config(**_COMMON),
    "mistral-window": lambda: transformers.MistralConfig(**_COMMON, sliding_window=WINDOW),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    # Sliding and global layers in two KV cache groups; soft-capped scores.
    "gemma2": lambda: transformers.Gemma2Config(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
    ),
    # q/k norms, a rope per layer kind, sandwich norms, GeGLU.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        },
    ),
    "phi3": lambda: transformers.Phi3Config(**_COMMON, sliding_window=None),
    # Partial rotary (half of each head's dims), sandwich norms.
    "glm4": lambda: transformers.Glm4Config(**_COMMON, head_dim=16, partial_rotary_factor=0.5),
    # LayerNorms with biases, attention and a plain GELU (tanh) MLP in parallel from one norm,
    # biases on q/k/v, dense, fc1 and fc2, partial rotary.
    "phi2": lambda: transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5),
    # LayerNorms with biases, a SwiGLU MLP, q/k/v biases, a quarter of each head rotated.
    "stablelm": lambda: transformers.StableLmConfig(
        **_COMMON, use_qkv_bias=True, partial_rotary_factor=0.25
    ),
    # Its parallel residual: attention and MLP from the input LayerNorm.
    "stablelm-parallel": lambda: transformers.StableLmConfig(
        **_COMMON, use_parallel_residual=True, partial_rotary_factor=0.5
    ),
    # LayerNorms with biases, q/k/v/o biases, a plain GELU (tanh) MLP with biases, a window.
    "starcoder2": lambda: transformers.Starcoder2Config(
        **_COMMON, sliding_window=WINDOW, hidden_act="gelu_pytorch_tanh"
    ),
    # The exact (erf) GELU, no biases.
    "starcoder2-erf": lambda: transformers.Starcoder2Config(
        **_COMMON, hidden_act="gelu", use_bias=False
    ),
    # Routed experts (kernels/cpu/moe.c): softmax top-2 of 4, renormalised.
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2
    ),
    # A shared expert (its own intermediate size) with its sigmoid gate, top-k not
    # renormalised, q/k/v biases, and a dense layer between the MoE ones.
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # Latent attention (kernels/cpu/mla_attention.c) with a plain q_proj, a dense layer, then
    # DeepSeek's MoE blocks (greedy softmax top-2 of 4, a shared expert added without a gate).
    "deepseek-v2": lambda: transformers.DeepseekV2Config(
        **_COMMON,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
    ),
    # q/k norms, top-3 of 8 renormalised.
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}
# What the step does not run yet, and the reason the plan gives.
MODULES: dict[str, tuple[Callable[[], transformers.PretrainedConfig], str]] = {
    # The gated MLP's exact (erf) GELU: the step's gated MLPs run SiLU and GELU tanh.
    "llama-gelu-erf": (
        lambda: transformers.LlamaConfig(**_COMMON, hidden_act="gelu"),
        "the gelu activation in a gated MLP (native: silu, gelu_tanh)",
    ),
}


def _folder(tmp_path: Path, make: Callable[[], transformers.PretrainedConfig]) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(make()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms of 1 (Gemma: 0) would hide a mix-up
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
        for name, b in hf.named_buffers():  # DeepSeek-V3's, zeros as HF inits it
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _engine(folder: Path, dtype: str, **extra: Any) -> LLM:
    return LLM(
        str(folder),
        **extra,
        dtype=dtype,
        device="cpu",
        attention_backend="cpu",
        block_size=8,
        kv_cache_memory=4 * 1024**2,
        max_num_batched_tokens=24,  # prompts prefill in chunks, beside decodes
        enable_prefix_caching=False,
        seed=3,
    )


class StepCalls:
    """Counts the steps the native step ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ran = 0
        own = decoder_stack.CpuDecoderStack.__call__

        def call(step, *args, **kwargs):
            self.ran += 1
            return own(step, *args, **kwargs)

        monkeypatch.setattr(decoder_stack.CpuDecoderStack, "__call__", call)


def _with_and_without_the_step(
    monkeypatch: pytest.MonkeyPatch, llm: LLM, params: SamplingParams
) -> tuple[list, list]:
    """(tokens and logprobs per prompt of MIXED_PROMPTS) with the modules, then with the
    runner's native step, on one engine (one plan); shuts the engine down."""
    runner = llm.engine.core.model_runner
    step = runner.native_step
    results = []
    try:
        for enabled in (False, True):
            runner.native_step = step if enabled else None
            calls = StepCalls(monkeypatch)
            outs = llm.generate(MIXED_PROMPTS, params)
            results.append(
                [
                    (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                    for o in outs
                ]
            )
            assert (calls.ran > 0) == enabled
    finally:
        llm.shutdown()
    return results[0], results[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("family", "kernel"),
    [(family, PANELS) for family in NATIVE]
    + [("qwen3", NATIVE_GEMM), ("gemma3", NATIVE_GEMM), ("qwen2-moe", NATIVE_GEMM)],
)
def test_the_native_step_generates_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str, kernel: str, dtype: str
) -> None:
    """Every matmul planned on `kernel` (the timer is forced: tiny shapes might not choose
    it): the native panels, or the native skinny matmul on the dense weight."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, kernel)
    llm = _engine(_folder(tmp_path / "model", NATIVE[family]), dtype)
    runner = llm.engine.core.model_runner
    step = runner.native_step
    assert step is not None, runner.prepared.native_reason
    # Sliding-window layers keep a KV pool of their own (their block tables, their slots).
    windowed = family.startswith(("gemma2", "gemma3", "mistral")) or family == "starcoder2"
    assert runner.kv_groups.hybrid == windowed
    # Float experts as the experts' plan laid them out, read by both paths (experts_plan.py).
    packed = plan_experts(getattr(torch, dtype), default_kernels()).layout == "panels"
    for layer in step.layers:
        assert layer.moe is None or isinstance(layer.moe.w13, PanelExperts) == packed
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 10 for tokens, _ in native)


@pytest.mark.parametrize("family", list(MODULES))
def test_families_the_step_does_not_run_say_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    make, why = MODULES[family]
    llm = _engine(_folder(tmp_path / "model", make), "float32")
    try:
        prepared = llm.engine.core.model_runner.prepared
        assert prepared.native_step is None
        assert "layer 0: " in prepared.native_reason and why in prepared.native_reason
        assert "decoder layers: module by module (layer 0: " in prepared.describe()
    finally:
        llm.shutdown()


def test_the_plan_names_every_planned_weight(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, PANELS)
    (tmp_path / "model").mkdir()
    llm = _engine(_folder(tmp_path / "model", NATIVE["qwen3"]), "float32")
    try:
        prepared = llm.engine.core.model_runner.prepared
        text = prepared.describe()
        assert "decoder layers: one native call per step at 1-24 rows\n" in text
        assert "dtype: float32 (given)" in text
        # Row buckets whose matmuls lack a native kernel run module by module: the plan says
        # which (here the buckets past 4 rows, as if their kernels were PyTorch's).
        step = prepared.native_step
        own = decoder_stack.CpuDecoderStack._linear
        monkeypatch.setattr(
            decoder_stack.CpuDecoderStack,
            "_linear",
            lambda self, module, key, dtype: None if key > 2 else own(self, module, key, dtype),
        )
        assert step.row_coverage(24) == (
            "one native call per step at 1-4 rows; module by module at 5-24 rows"
        )
        assert step.row_coverage(1) == "one native call per step at 1 row"
        names = set(prepared.linear_plan.weights)
        layer_parts = {
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        }
        assert names == {f"model.layers.{i}.{p}" for i in range(3) for p in layer_parts} | {
            "lm_head"
        }
        assert all(f"  {name}: float32 (" in text for name in names)
        # Nothing hollowed: each planned weight gives its matrix back.
        w = prepared.model.get_submodule("model.layers.0.mlp.down_proj").weight
        assert w.source is None and w.dequantize().abs().sum() > 0
    finally:
        llm.shutdown()


def _rank0_times_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 (this process) plans from its forced timer, never from the cache: the spawned
    rank times its shards for real and caches them in the same file, and read by rank 0 those
    timings could plan it off the native step (a race on which rank writes first)."""
    monkeypatch.setattr(TuningCache, "get", lambda self, key: None)


class _QuietWindow:
    """The tuner's load window on a machine counted as quiet: its timings are cached."""

    def others_share(self) -> float:
        return 0.0

    def busy_machine(self) -> bool:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "rank0_modules_for_prefill"),
    [
        ("qwen3", False),
        ("gemma3", False),
        ("qwen3", True),
        ("starcoder2", False),
        ("phi2", False),
        ("stablelm-parallel", False),
    ],
)
def test_tensor_parallel_ranks_run_the_native_step_between_all_reduces(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shared_cache_dir: Path,
    family: str,
    rank0_modules_for_prefill: bool,
) -> None:
    """TP=2 (rank 0 here, rank 1 a spawned worker) with one native call per half layer and the
    all-reduces between them gives TP=1's greedy tokens, and its logprobs up to the order of the
    partial sums (fp32). Rank 0's timer is forced onto the panels; rank 1 reads the timings
    cached (by TP=1 runs and earlier ranks) where its shapes match them and times the rest.

    Ranks time and plan their own shards, so one may run a row count module by module while
    the other runs it natively: `rank0_modules_for_prefill` makes rank 0 do so for every step
    of more than 4 rows (the prefill chunks). Both paths issue the same collectives (an
    embedding once issued twice on the declining rank shifted every all-reduce after it)."""
    from model_server.kernels.cpu import linear_tuning

    monkeypatch.setenv("WICK_CACHE_DIR", str(shared_cache_dir))  # the rank loads this build
    force(monkeypatch, PANELS)
    monkeypatch.setattr(linear_tuning, "LoadWindow", _QuietWindow)
    _rank0_times_its_own(monkeypatch)
    folder = _folder(tmp_path / "model", NATIVE[family])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    results = []
    own_takes = decoder_stack.CpuDecoderStack.takes

    def small_steps_only(step: Any, num_tokens: int, kv_caches: Any) -> bool:
        return num_tokens <= 4 and own_takes(step, num_tokens, kv_caches)

    for tp in (1, 2):
        if tp == 2 and rank0_modules_for_prefill:
            monkeypatch.setattr(decoder_stack.CpuDecoderStack, "takes", small_steps_only)
        calls = StepCalls(monkeypatch)
        llm = LLM(
            str(folder),
            dtype="float32",
            device="cpu",
            attention_backend="cpu",
            block_size=8,
            kv_cache_memory=4 * 1024**2,
            max_num_batched_tokens=24,
            tensor_parallel_size=tp,
            num_threads=1,
        )
        try:
            assert llm.engine.core.model_runner.native_step is not None
            outs = llm.generate(MIXED_PROMPTS, params)
        finally:
            llm.shutdown()
        assert calls.ran > 0
        results.append(
            [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        )
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(*results, strict=True):
        assert tokens_2 == tokens_1 and len(tokens_1) == 10
        torch.testing.assert_close(logprobs_2, logprobs_1, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3-moe", "float32"), ("qwen2-moe", "float32"), ("qwen3-moe", "bfloat16"),
     ("qwen2-moe", "bfloat16")],
)  # fmt: skip
def test_tensor_parallel_ranks_run_moe_layers_natively(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shared_cache_dir: Path,
    family: str,
    dtype: str,
) -> None:
    """MoE layers under TP=2: each rank's native step runs its slices of every expert (and of
    Qwen2-MoE's shared expert), the partial sums all-reduced between calls as the modules
    reduce them. Rank 0 with the step gives rank 0 without it (the modules) the same bits, and
    TP=1's greedy tokens, its logprobs up to the order of the partial sums."""
    from model_server.kernels.cpu import linear_tuning

    monkeypatch.setenv("WICK_CACHE_DIR", str(shared_cache_dir))
    force(monkeypatch, NATIVE_GEMM)
    monkeypatch.setattr(linear_tuning, "LoadWindow", _QuietWindow)
    _rank0_times_its_own(monkeypatch)
    step = tp2_native_matches_tp1(monkeypatch, _folder(tmp_path / "model", NATIVE[family]), dtype)
    assert any(layer.moe is not None and layer.tp_size == 2 for layer in step.layers)


def tp2_native_matches_tp1(
    monkeypatch: pytest.MonkeyPatch, folder: Path, dtype: str
) -> decoder_stack.CpuDecoderStack:
    """TP=1 with its native step, then TP=2 (rank 1 a spawned worker) whose rank 0 generates
    with its native step and without it: the same bits, and TP=1's greedy tokens, its logprobs
    up to the order of the partial sums (bf16: their rounding). Returns TP=2's rank-0 step
    (its engine shut down)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = _engine(folder, dtype, num_threads=1)
    try:
        assert llm.engine.core.model_runner.native_step is not None
        one_rank = _outputs(llm.generate(MIXED_PROMPTS, params))
    finally:
        llm.shutdown()
    llm = _engine(folder, dtype, tensor_parallel_size=2, num_threads=1)
    runner = llm.engine.core.model_runner
    step = runner.native_step
    if step is None or step.all_reduce is None:
        llm.shutdown()
        pytest.fail(f"TP=2 runs no native step: {runner.prepared.native_reason}")
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(one_rank, native, strict=True):
        assert tokens_2 == tokens_1 and len(tokens_1) == 8
        tol = 1e-4 if dtype == "float32" else 0.1
        torch.testing.assert_close(
            [lp for lp, _ in logprobs_2], [lp for lp, _ in logprobs_1], atol=tol, rtol=tol
        )
    return step


def _outputs(outs: list) -> list:
    return [
        (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def quantized_folder(folder: Path, out: Path, method: str) -> Path:
    """`folder` written by `wick quantize`'s writer: 4 bits, group 32, `method` gptq (symmetric),
    awq, or gptq-act-order (`desc_act`: each projection's codes in a pseudo-random order of
    its input features)."""
    from model_server.loader.load import load_model_source
    from model_server.loader.write_quantized import write_quantized_folder

    act_order = method == "gptq-act-order"
    method = method.removesuffix("-act-order")
    source = load_model_source(str(folder))
    return write_quantized_folder(
        source, out, method, 4, 32, sym=method == "gptq", desc_act=act_order
    )


@pytest.mark.parametrize("method", ["gptq", "awq", "gptq-act-order"])
def test_the_native_step_runs_gptq_and_awq_weights_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, method: str
) -> None:
    """A checkpoint kept in its 4-bit codes (written by `wick quantize`, group 32): every
    projection on the native wNa16 kernel, in the native step as in the modules; act-order
    (`desc_act`): each input's columns gathered in its codes' order first, in C as in the
    module's index_select."""
    from model_server.kernels.cpu.linear_tuning import WNA16_NATIVE

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, WNA16_NATIVE)
    folder = _folder(tmp_path / "model", NATIVE["qwen3"])
    quantized = quantized_folder(folder, tmp_path / "q", method)
    act_order = method.endswith("-act-order")
    method = method.removesuffix("-act-order")
    llm = _engine(quantized, "bfloat16")
    runner = llm.engine.core.model_runner
    step = runner.native_step
    assert step is not None, runner.prepared.native_reason
    description = runner.prepared.quantization_description
    assert description.startswith(method) and ("act-order" in description) == act_order
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_step_runs_int8_weights_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: str
) -> None:
    """`-q int8` on the CPU holds its weights as 8-bit per-channel wNa16 codes
    (`int8_weights_layout`): every projection on the native wNa16 kernel, in the native step as
    in the modules."""
    from model_server.kernels.cpu.linear_tuning import WNA16_NATIVE

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, WNA16_NATIVE)
    folder = _folder(tmp_path / "model", NATIVE["qwen3"])
    llm = _engine(folder, dtype, quantization="int8")
    runner = llm.engine.core.model_runner
    assert runner.prepared.resolved.int8_layout == "wna16"
    assert runner.prepared.quantization_description == "int8"
    assert runner.native_step is not None, runner.prepared.native_reason
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules


@pytest.mark.slow
def test_a_resolution_error_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    """The config is resolved on rank 0 and broadcast: an error there (a float checkpoint asked
    to be served as GPTQ) is raised on every rank at once, not a worker left waiting."""
    import time

    folder = _folder(tmp_path / "model", NATIVE["qwen3"])
    start = time.perf_counter()
    with pytest.raises(ValueError, match="gptq"):
        LLM(str(folder), quantization="gptq", tensor_parallel_size=2, num_threads=1)
    assert time.perf_counter() - start < 120


def test_layer_norm_layers_are_described_and_what_the_step_lacks_is_named() -> None:
    """Phi-2's layers as the model describes them (LayerNorms with biases, one norm feeding
    attention and a plain GELU MLP in parallel), and the variants decoder_stack.c does not run,
    each refused with the layer and what it has."""
    import dataclasses

    from model_server.layers.attention import get_attention_backend
    from model_server.models import build_model

    config = transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5)
    config.architectures = ["PhiForCausalLM"]
    model = build_model(config, get_attention_backend("cpu"))
    layers = model.model.stack_layers()
    assert isinstance(layers, tuple) and len(layers) == 3
    layer = layers[0]
    assert (layer.norm, layer.mlp, layer.activation) == ("layer", "plain", "gelu_tanh")
    assert layer.parallel_residual and layer.post_attention_norm is None
    assert layer.input_norm_bias is model.model.layers[0].input_layernorm.bias
    assert layer.gate_up is model.model.layers[0].mlp.fc1
    assert layer.rotary_dim == 8  # half of each head of 16
    assert decoder_stack._native_reason(layers, torch.float32) is None

    def reason(**changes: Any) -> str | None:
        changed = (dataclasses.replace(layer, **changes), *layers[1:])
        return decoder_stack._native_reason(changed, torch.float32, lambda t: t)

    assert reason(tp_size=2) is None  # the two partial sums reduced apart (the TP cases)
    assert reason(mlp_out_norm=layer.input_norm) == "layer 0: sandwich norms after LayerNorms"
    assert reason(activation="silu") == (
        "layer 0: the silu activation in a plain MLP (native: gelu, gelu_tanh)"
    )
    assert reason(norm="rms") == "layer 0: RMSNorms with biases"
    assert reason(post_attention_norm=layer.input_norm) == (
        "layer 0: a parallel residual with a norm before the MLP, or neither"
    )
    half = layer.input_norm_bias.to(torch.bfloat16)
    assert "not contiguous torch.float32 CPU tensors" in reason(input_norm_bias=half)


def test_moe_layers_are_described_and_what_the_step_lacks_is_named() -> None:
    """Qwen2-MoE's layers as its blocks describe themselves (router, stacked experts, top-k,
    the shared expert's MLP and gate; a dense layer between), Mixtral's without a shared
    expert, and the MoE variants decoder_stack.c does not run, each named."""
    import dataclasses

    from model_server.layers.attention import get_attention_backend
    from model_server.models import build_model

    config = NATIVE["qwen2-moe"]()
    config.architectures = ["Qwen2MoeForCausalLM"]
    model = build_model(config, get_attention_backend("cpu"))
    layers = model.model.stack_layers()
    assert isinstance(layers, tuple) and len(layers) == 3
    block = model.model.layers[0].mlp
    moe = layers[0].moe
    assert moe is not None and layers[1].moe is None  # mlp_only_layers=[1]
    assert moe.router is block.gate and moe.w13 is block.experts.w13_weight
    assert (moe.top_k, moe.renormalize) == (2, False)
    assert moe.shared_gate is block.shared_expert_gate
    assert layers[0].gate_up is block.shared_expert.gate_up_proj
    assert decoder_stack._native_reason(layers, torch.float32) is None
    assert decoder_stack._native_reason(layers, torch.bfloat16) == (
        "layer 0: experts that are not contiguous torch.bfloat16 CPU tensors"
    )

    def reason(**changes: Any) -> str | None:
        changed = (dataclasses.replace(layers[0], **changes), *layers[1:])
        return decoder_stack._native_reason(changed, torch.float32, lambda t: t)

    assert reason(tp_size=2) is None  # each rank's slices of the experts (decoder_stack._run)
    assert reason(moe=dataclasses.replace(moe, w13=object())) == (
        "layer 0: experts kept as object (native: float or GPTQ/AWQ codes)"
    )
    assert reason(moe=dataclasses.replace(moe, shared_gate=None)) == (
        "layer 0: a shared expert without its gate, or a gate without the expert"
    )
    assert reason(mlp_out_norm=layers[0].input_norm) == (
        "layer 0: sandwich norms around an MoE block"
    )

    mixtral = NATIVE["mixtral"]()
    mixtral.architectures = ["MixtralForCausalLM"]
    described = build_model(mixtral, get_attention_backend("cpu")).model.stack_layers()
    assert isinstance(described, tuple)
    assert described[0].gate_up is None and described[0].down is None
    assert described[0].moe.shared_gate is None and described[0].moe.renormalize
    assert decoder_stack._native_reason(described, torch.float32) is None
