"""DeepSeek's multi-head latent attention in the native decoder step (kernels/cpu/decoder_stack.c
with mla_attention.c): on tiny random DeepSeek-V2 models whose layers are all dense
(first_k_dense_replace covers them, so latent attention is the step's only DeepSeek part), one
engine generates with the step and without it (the modules, whose `cpu` backend runs the same
MLA kernel): the same greedy tokens and top logprobs, in fp32 and bf16, prefill chunks after
cached tokens mixed with decodes; q through a plain q_proj or through its LoRA, default or yarn
rope (DeepSeek's interleaved rope rows de-interleaved at load). What the step does not run is
named."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from model_server.kernels.cpu import decoder_stack
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import NATIVE as NATIVE_GEMM
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import force
from tests.kernels.test_native_step_families import (
    _COMMON,
    _engine,
    _folder,
    _with_and_without_the_step,
)
from tests.models.test_parity_moe import DEEPSEEK_YARN

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

_MLA = dict(
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=_COMMON["num_hidden_layers"],  # every layer dense
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "q-proj": lambda: transformers.DeepseekV2Config(**_COMMON, **_MLA, q_lora_rank=None),
    "q-lora-yarn": lambda: transformers.DeepseekV2Config(
        **_COMMON, **_MLA, q_lora_rank=24, rope_parameters=DEEPSEEK_YARN
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("config", "kernel"),
    [(config, PANELS) for config in CONFIGS] + [("q-lora-yarn", NATIVE_GEMM)],
)
def test_the_native_step_runs_latent_attention_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: str, kernel: str, dtype: str
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, kernel)
    llm = _engine(_folder(tmp_path / "model", CONFIGS[config]), dtype)
    runner = llm.engine.core.model_runner
    assert runner.native_step is not None, runner.prepared.native_reason
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    modules, native = _with_and_without_the_step(monkeypatch, llm, params)
    assert native == modules
    assert all(len(tokens) == 10 for tokens, _ in native)


def test_latent_attention_is_described_and_what_the_step_lacks_is_named() -> None:
    from model_server.layers.attention import get_attention_backend
    from model_server.models import build_model

    config = CONFIGS["q-lora-yarn"]()
    config.architectures = ["DeepseekV2ForCausalLM"]
    model = build_model(config, get_attention_backend("cpu"))
    layers = model.model.stack_layers()
    assert isinstance(layers, tuple) and len(layers) == 3
    attn = model.model.layers[0].self_attn
    mla = layers[0].mla
    assert mla is not None and layers[0].qkv is attn.kv_a_proj_with_mqa
    assert mla.q_a is attn.q_a_proj and mla.q_b is attn.q_b_proj
    assert mla.w_kv_b.data_ptr() == attn.kv_b_proj.weight.data_ptr()
    assert (layers[0].num_kv_heads, layers[0].head_dim, layers[0].rotary_dim) == (1, 40, 8)
    assert layers[0].scale == attn.mla.scale
    assert decoder_stack._native_reason(layers, torch.float32) is None

    def reason(**changes) -> str | None:
        changed = (dataclasses.replace(layers[0], **changes), *layers[1:])
        return decoder_stack._native_reason(changed, torch.float32, lambda t: t)

    assert reason(tp_size=2) is None  # this rank's heads (test_native_step_moe_deepseek's TP case)
    assert reason(mla=dataclasses.replace(mla, w_kv_b=mla.w_kv_b[:-1])) == (
        "layer 0: latent attention's kv_b_proj of shape (111, 32)"
    )
    assert reason(mla=dataclasses.replace(mla, q_a_norm=None)) == (
        "layer 0: latent attention's q LoRA without its norm, or a norm without it"
    )
    assert reason(attention_backend="torch (MLA)") == (
        "layer 0: the torch (MLA) attention backend (not the native cpu one)"
    )
    torch_model = build_model(config, get_attention_backend("torch"))
    described = torch_model.model.stack_layers()
    assert isinstance(described, tuple) and described[0].attention_backend == "torch (MLA)"
