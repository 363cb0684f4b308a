"""Parity with HF transformers of the families beyond Llama: Gemma 1/2/3, Phi-3, Phi-2, StableLM,
GLM-4, on tiny random configs saved as real HF safetensors folders.

The same checks as test_parity_tiny.py (the test functions are imported from there and run on
this module's `pair` fixture): prefill logits, 32 greedy tokens equal to `generate`, chunked
prefill, a mixed batch, and the CPU platform's kernels. Windows are smaller than the prompts
(8 tokens against 20) and the soft caps small enough to bite, so sliding-window masking and
soft-capping change the results; Gemma 3's local layers get their own rope base.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from model_server.layers.attention import get_attention_backend
from model_server.layers.rotary import longrope_inv_freqs, rope_parameters_from_config
from model_server.models import build_model, get_model_class
from model_server.platforms.cpu import CpuPlatform
from tests.models.test_parity_tiny import (  # noqa: F401  (tests collected here too)
    MAX_MODEL_LEN,
    VOCAB,
    Pair,
    test_chunked_prefill_matches_whole,
    test_greedy_tokens_match_hf_generate,
    test_mixed_batch_matches_per_sequence,
    test_native_cpu_kernels_match_portable_and_hf,
    test_prefill_logits_match_hf,
)

WINDOW = 8

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_MODEL_LEN,
    initializer_range=0.05,
)

_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0],
    "original_max_position_embeddings": 64,
}


# Phi-3's default special ids (32000) lie outside the tiny vocabulary (GLM-4's too).
_PHI3_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3(**kw: object) -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        },
        **kw,
    )


CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    # Sliding layer then global layer; soft caps that change the scores and logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **_COMMON,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
    ),
    "gemma3": _gemma3,
    # Phi-3 mini's layout: fused qkv_proj / gate_up_proj in the checkpoint, LongRoPE, a window
    # on every layer.
    "phi3_longrope_window": lambda: transformers.Phi3Config(
        **_COMMON,
        **_PHI3_TOKENS,
        rope_parameters=dict(_LONGROPE),
        original_max_position_embeddings=64,  # 128 / 64: an attention factor > 1
        sliding_window=WINDOW,
    ),
    "phi3_plain": lambda: transformers.Phi3Config(**_COMMON, **_PHI3_TOKENS, sliding_window=None),
    # Phi-2: parallel attention + MLP, half the head rotated, biases everywhere.
    "phi2": lambda: transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5),
    "stablelm_qkv_bias": lambda: transformers.StableLmConfig(
        **_COMMON, use_qkv_bias=True, partial_rotary_factor=0.25
    ),
    "stablelm_parallel_residual": lambda: transformers.StableLmConfig(
        **_COMMON, use_parallel_residual=True, partial_rotary_factor=0.5
    ),
    # Interleaved partial rotary, q/k/v bias, sandwich norms.
    "glm4": lambda: transformers.Glm4Config(
        **_COMMON, head_dim=16, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    with torch.no_grad():
        # HF inits biases to 0 and norms to 1 (Gemma: 0): perturb them so loading is tested.
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    config = transformers.AutoConfig.from_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    ours = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    loaded = ours.load_weights(weights.items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    native = build_model(
        config,
        get_attention_backend("cpu"),
        max_model_len=MAX_MODEL_LEN,
        kernels=CpuPlatform().kernel_table(),
    )
    native.load_weights(weights.items())
    return Pair(hf=hf, ours=ours, config=config, native=native)


def test_registry_maps_family_architectures() -> None:
    for arch in ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert get_model_class([arch]).__name__ == "GemmaForCausalLM"
    assert get_model_class(["Phi3ForCausalLM"]).__name__ == "LlamaForCausalLM"
    assert get_model_class(["PhiForCausalLM"]).__name__ == "PhiForCausalLM"
    assert get_model_class(["StableLmForCausalLM"]).__name__ == "StableLmForCausalLM"
    assert get_model_class(["Glm4ForCausalLM"]).__name__ == "Glm4ForCausalLM"


def test_longrope_frequencies_match_transformers() -> None:
    """Both factor sets and the attention factor equal transformers' own computation (the
    parity runs above stay below the original length, so they only see the short factors)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS["phi3_longrope_window"]()
    params = rope_parameters_from_config(config)
    short, long, factor = longrope_inv_freqs(16, params, config.max_position_embeddings)
    hf_short, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=10)
    hf_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=100)
    assert torch.equal(short, hf_short) and torch.equal(long, hf_long)
    assert factor == pytest.approx(hf_factor) and factor > 1.0


def test_a_backend_without_windows_or_soft_caps_refuses_in_one_line() -> None:
    """The contract's refusal: a backend that does not declare support stops the model's
    construction with one line naming the backend and the feature."""
    from model_server.layers.attention.backend import AttentionBackend

    class PlainBackend(AttentionBackend):
        name = "plain"

        def forward(self, q, k, v, k_cache, v_cache, metadata):  # pragma: no cover
            raise AssertionError("never runs")

    config = CONFIGS["gemma2"]()
    config.architectures = ["Gemma2ForCausalLM"]
    with pytest.raises(ValueError, match="the plain attention backend does not implement") as exc:
        build_model(config, PlainBackend, max_model_len=MAX_MODEL_LEN)
    assert "\n" not in str(exc.value)
