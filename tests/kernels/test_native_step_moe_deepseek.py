"""DeepSeek's MoE block in the native decoder step (kernels/cpu/decoder_stack.c with
moe_routing.c): the grouped top-k router on fp32 logits, the routed experts and the shared
experts added without a gate, beside a dense layer (first_k_dense_replace). One engine
generates with the step and without it (the modules): the same greedy tokens and top
logprobs, in fp32 and bf16, prefill chunks mixed with decodes.

Whole DeepSeek-V2 and V3 models (latent attention included, kernels/cpu/mla_attention.c) from
tiny random HF checkpoints (norms, biases and V3's correction bias perturbed); and, to hold
the MoE block alone to the modules' bits, DeepSeek's block (models/deepseek.py's `DeepseekMoE`,
V2 and V3 routers, with and without shared experts) behind Qwen2-MoE's fused q/k/v attention,
random weights (load_format dummy)."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from model_server.kernels.cpu import abi, decoder_stack
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import NATIVE as NATIVE_GEMM
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.layers.attention import get_attention_backend
from model_server.models import build_model
from model_server.models.deepseek import DeepseekMoE
from model_server.models.qwen_moe import QwenMoeForCausalLM
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import force
from tests.kernels.test_native_step_families import (
    _COMMON,
    _engine,
    _folder,
    _QuietWindow,
    _rank0_times_its_own,
    _with_and_without_the_step,
    tp2_native_matches_tp1,
)

_DEEPSEEK = dict(
    _COMMON,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
)
MODELS: dict[str, Any] = {
    # softmax, the best 2 of 4 groups, 2 shared experts, a plain q projection
    "deepseek-v2": lambda: transformers.DeepseekV2Config(
        **_DEEPSEEK,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    # sigmoid, noaux_tc with the correction bias, renormalised, q through its LoRA
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **_DEEPSEEK,
        q_lora_rank=24,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

# The DeepSeek blocks' configs (models/deepseek.py reads these fields).
_MOE = dict(
    hidden_size=_COMMON["hidden_size"],
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    hidden_act="silu",
    mlp_bias=False,
)
ROUTERS: dict[str, dict[str, Any]] = {
    # softmax, the best 2 of 4 groups, 2 shared experts, weights not renormalised
    "v2": dict(
        model_type="deepseek_v2",
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
    ),
    "v2-greedy": dict(
        model_type="deepseek_v2",
        topk_method="greedy",
        n_group=None,
        topk_group=None,
        n_shared_experts=None,  # routed experts alone
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
    ),
    # sigmoid, the correction bias, groups by their two best, renormalised, 1 shared expert
    "v3": dict(
        model_type="deepseek_v3",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_deepseek_models_generate_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, dtype: str
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, PANELS)
    llm = _engine(_folder(tmp_path / "model", MODELS[name]), dtype)
    runner = llm.engine.core.model_runner
    step = runner.native_step
    assert step is not None, runner.prepared.native_reason
    layers = step.layers
    assert layers[0].moe is None and all(layer.moe is not None for layer in layers[1:])
    grouped = layers[1].moe.grouped
    assert grouped is not None and layers[1].moe.shared_add == "plain"
    v3 = name == "deepseek-v3"
    assert (grouped.scoring, grouped.correction_bias is not None) == (
        ("sigmoid", True) if v3 else ("softmax", False)
    )
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 10 for tokens, _ in native)


def _deepseek_blocks(monkeypatch: pytest.MonkeyPatch, router: str) -> None:
    """Qwen2-MoE's MoE layers build DeepSeek's block instead (its dense layer 0 stays: the
    first_k_dense_replace of DeepSeek-V2-Lite)."""
    config = SimpleNamespace(**_MOE, **ROUTERS[router])
    own = QwenMoeForCausalLM.make_layer_parts

    def parts(self: Any, hf_config: Any, layer_idx: int, *args: Any) -> Any:
        attn, mlp = own(self, hf_config, layer_idx, *args)
        if layer_idx == 0:  # mlp_only_layers=[0]: the dense MLP
            return attn, mlp
        return attn, DeepseekMoE(config, args[-1])

    monkeypatch.setattr(QwenMoeForCausalLM, "make_layer_parts", parts)


def _qwen_moe_config() -> transformers.Qwen2MoeConfig:
    """The Qwen2-MoE whose MoE layers `_deepseek_blocks` turns into DeepSeek's (layer 0 dense)."""
    config = transformers.Qwen2MoeConfig(
        **_COMMON,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
    )
    config.architectures = ["Qwen2MoeForCausalLM"]
    return config


def _config_folder(tmp_path: Path) -> Path:
    _qwen_moe_config().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("router", "kernel"),
    [("v2", PANELS), ("v3", PANELS), ("v2-greedy", PANELS), ("v3", NATIVE_GEMM)],
)
def test_deepseek_moe_blocks_generate_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, router: str, kernel: str, dtype: str
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, kernel)
    _deepseek_blocks(monkeypatch, router)
    llm = _engine(_config_folder(tmp_path / "model"), dtype, load_format="dummy")
    runner = llm.engine.core.model_runner
    step = runner.native_step
    assert step is not None, runner.prepared.native_reason
    layers = step.layers
    assert layers[0].moe is None and all(layer.moe is not None for layer in layers[1:])
    moe = layers[1].moe
    assert moe.grouped is not None and moe.shared_add == "plain" and moe.shared_gate is None
    assert (layers[1].gate_up is None) == (ROUTERS[router]["n_shared_experts"] is None)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 10 for tokens, _ in native)


def test_what_the_step_lacks_of_a_deepseek_block_is_named(monkeypatch: pytest.MonkeyPatch):
    """The description of a DeepSeek block, and what decoder_stack.c refuses of it."""
    _deepseek_blocks(monkeypatch, "v3")
    model = build_model(_qwen_moe_config(), get_attention_backend("cpu"))
    layers = model.model.stack_layers()
    assert isinstance(layers, tuple)
    block = model.model.layers[1].mlp
    moe = layers[1].moe
    assert moe.grouped.weight is block.gate.weight and moe.grouped.weight.dtype == torch.float32
    assert moe.grouped.correction_bias is block.gate.e_score_correction_bias
    assert (moe.grouped.scoring, moe.grouped.topk_method) == ("sigmoid", "noaux_tc")
    assert layers[1].gate_up is block.shared_experts.gate_up_proj
    assert decoder_stack._native_reason(layers, torch.float32) is None

    def reason(**changes: Any) -> str | None:
        changed = (layers[0], dataclasses.replace(layers[1], **changes), *layers[2:])
        return decoder_stack._native_reason(changed, torch.float32)

    grouped = moe.grouped
    assert (
        reason(moe=dataclasses.replace(moe, grouped=dataclasses.replace(grouped, n_group=3)))
        == "layer 1: a grouped top-k router with the best 2 of 3 groups of 8 experts"
    )
    assert reason(moe=dataclasses.replace(moe, shared_gate=block.gate)) == (
        "layer 1: a shared expert gate on a plain shared expert add"
    )
    assert reason(moe=dataclasses.replace(moe, shared_add="scaled")) == (
        "layer 1: a shared expert added scaled (native: gated, plain)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_plain_shared_add_is_the_modules_add(dtype: torch.dtype) -> None:
    """Under tensor parallelism the step leaves the routed experts' reduced sum in `sandwich`
    and the shared experts' in hidden_out; wick_stack_moe_shared_add then adds them as the
    modules do (`routed + shared`, one add in the dtype), no gate read."""
    gen = torch.Generator().manual_seed(1)
    routed = torch.randn(3, 40, generator=gen).to(dtype)
    shared = torch.randn(3, 40, generator=gen).to(dtype)
    out = shared.clone()
    step = abi.structure("WickStackStep")()
    step.dtype = 0 if dtype == torch.float32 else 1
    step.num_tokens, step.hidden = 3, 40
    step.sandwich, step.hidden_out = routed.data_ptr(), out.data_ptr()
    layer = abi.structure("WickLayer")()
    layer.moe.num_experts, layer.moe.top_k, layer.moe.has_shared = 8, 2, 1
    layer.moe.shared_kind = abi.constant("MOE_SHARED_PLAIN")
    lib = default_kernels().lib
    assert lib.wick_stack_moe_shared_add(ctypes.addressof(step), ctypes.addressof(layer)) == 0
    assert torch.equal(out, routed + shared)
    layer.moe.has_shared = 0
    assert lib.wick_stack_moe_shared_add(ctypes.addressof(step), ctypes.addressof(layer)) == -1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "dtype"), [("deepseek-v2", "float32"), ("deepseek-v3", "bfloat16")]
)
def test_tensor_parallel_ranks_run_deepseek_natively(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shared_cache_dir: Path,
    name: str,
    dtype: str,
) -> None:
    """DeepSeek under TP=2: each rank's native step runs latent attention over its half of the
    heads (its rows of q_b_proj / q_proj and kv_b_proj, the latent replicated), then o_proj's
    partial sum, all-reduced; the MoE layers their slices of every expert, the routed and the
    shared experts' sums reduced apart and added as the modules add them. Rank 0 with the step
    gives rank 0 without it the same bits, and TP=1's greedy tokens, its logprobs up to the
    order of the partial sums."""
    from model_server.kernels.cpu import linear_tuning

    monkeypatch.setenv("WICK_CACHE_DIR", str(shared_cache_dir))
    force(monkeypatch, NATIVE_GEMM)
    monkeypatch.setattr(linear_tuning, "LoadWindow", _QuietWindow)
    _rank0_times_its_own(monkeypatch)
    step = tp2_native_matches_tp1(monkeypatch, _folder(tmp_path / "model", MODELS[name]), dtype)
    assert all(layer.mla is not None and layer.tp_size == 2 for layer in step.layers)
    assert step.layers[0].num_heads == _DEEPSEEK["num_attention_heads"] // 2
    assert step.layers[1].moe is not None
