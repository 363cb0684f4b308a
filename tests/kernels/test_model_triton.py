"""A whole model on the Triton backend (interpreted on CPUs) generates exactly what the portable
backend generates: tiny random Llama/Qwen3 configs, Gemma 2's windows and soft caps, DeepSeek-V2's
latent attention; greedy, a batch mixing prompt lengths."""

from __future__ import annotations

import json

import pytest

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, TINY_CONFIGS, tiny_llm

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_triton_backend_generates_like_torch(tmp_path, name: str, device: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = tiny_llm(tmp_path, name, attention_backend=backend, device=device)
        assert llm.engine.core.model_runner.attn_backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 12 for t in outputs["torch"])


# Gemma 2's layout: a sliding layer (window 8, shorter than every prompt + output here) then a
# global one, attention and final-logit soft caps; the sliding layer's KV in its own pool.
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "attn_logit_softcapping": 1.0,
    "final_logit_softcapping": 2.0,
    "initializer_range": 0.05,
}


def test_triton_backend_runs_gemma2_windows_and_soft_caps_like_torch(tmp_path, device) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            dtype="float32",
            device=device,
            attention_backend=backend,
            block_size=8,
            kv_cache_memory=2 * 1024**2,
            max_num_batched_tokens=24,
            seed=3,
        )
        assert llm.engine.core.kv_cache_manager.sliding is not None
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 12 for t in outputs["torch"])


# DeepSeek-V2's latent attention (a q LoRA, yarn-free rope, a dense first layer then MoE).
DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "initializer_range": 0.05,
}


def test_triton_backend_runs_deepseek_latent_attention_like_torch(tmp_path, device) -> None:
    """MLA on the triton backend: latents stored and decodes read by the Triton kernels, the
    cache one latent + rope row per token as on the other backends."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            dtype="float32",
            device=device,
            attention_backend=backend,
            block_size=8,
            kv_cache_memory=2 * 1024**2,
            max_num_batched_tokens=24,
            seed=3,
        )
        runner = llm.engine.core.model_runner
        assert runner.kv_caches[0].shape[1:] == (8, 32 + 8)
        mla = runner.model.model.layers[0].self_attn.mla
        assert mla.decode_kernel == ("triton" if backend == "triton" else "torch")
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 12 for t in outputs["torch"])
