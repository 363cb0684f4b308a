"""Parity of the mixture-of-experts families with HF transformers on tiny random configs.

Mixtral, Qwen2-MoE (shared expert with its gate, a dense layer from `mlp_only_layers`),
Qwen3-MoE (q/k norm, `norm_topk_prob`), DeepSeek-V2 (multi-head latent attention with the latent
KV cache, yarn rope, a dense first layer, group-limited routing) and DeepSeek-V3 (sigmoid routing
with the correction bias, grouped top-k, q LoRA) are saved by HF as real safetensors folders
(the checkpoint names HF writes), loaded through `load_weights`, and run through the paged path
(block_size 4, scrambled block ids) as test_parity_tiny does for the Llama family:
  - prefill logits close to HF's at every position,
  - 32 greedy tokens identical to `hf_model.generate`,
  - chunked prefill and a mixed batch (prefill + decode + a chunk after a cached prefix),
  - the CPU platform's kernels and "cpu" attention backend give the same logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from model_server.layers.attention import get_attention_backend
from model_server.models import build_model, get_model_class
from model_server.platforms.cpu import CpuPlatform
from tests.models.test_parity_tiny import (
    _COMMON,
    ATOL,
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    NUM_NEW_TOKENS,
    PROMPT_LEN,
    PagedHarness,
    Seq,
    _hf_logits,
    _prompt,
)

_MOE = {**_COMMON, "intermediate_size": 96}
_DEEPSEEK = dict(
    _MOE,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=32,
    n_shared_experts=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
)

# name -> tiny HF config; together they cover every MoE architecture in the registry.
# DeepSeek's yarn rope at a tiny model's scale (its mscale terms included).
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
MOE_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "mixtral": lambda: transformers.MixtralConfig(
        **_MOE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_MOE,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_MOE,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **_DEEPSEEK,
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        rope_parameters=DEEPSEEK_YARN,
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_DEEPSEEK,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}


@dataclass
class Pair:
    hf: nn.Module
    ours: nn.Module
    native: nn.Module
    folder: Path


def save_tiny(name: str, folder: Path) -> nn.Module:
    """The HF model for MOE_CONFIGS[name], with perturbed norms, biases and correction biases
    (HF inits them to constants), saved as a safetensors folder."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(MOE_CONFIGS[name]()).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def _build(folder: Path, backend: str, kernels=None) -> nn.Module:
    config = transformers.AutoConfig.from_pretrained(folder)
    extra = {} if kernels is None else {"kernels": kernels}
    model = build_model(
        config, get_attention_backend(backend), max_model_len=MAX_MODEL_LEN, **extra
    )
    loaded = model.load_weights(load_file(folder / "model.safetensors").items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return model


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder)
    ours = _build(folder, "torch")
    native = _build(folder, "cpu", CpuPlatform().kernel_table())
    return Pair(hf=hf, ours=ours, native=native, folder=folder)


class Harness(PagedHarness):
    """PagedHarness with the model's own KV cache layout where it has one (DeepSeek's latent)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if hasattr(model, "kv_cache_shape"):
            shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
            self.kv_caches = [torch.zeros(shape) for _ in range(model.num_layers)]


def test_registry_picks_the_moe_classes() -> None:
    names = {
        "MixtralForCausalLM": "MixtralForCausalLM",
        "Qwen2MoeForCausalLM": "QwenMoeForCausalLM",
        "Qwen3MoeForCausalLM": "QwenMoeForCausalLM",
        "DeepseekV2ForCausalLM": "DeepseekForCausalLM",
        "DeepseekV3ForCausalLM": "DeepseekForCausalLM",
    }
    for arch, cls in names.items():
        assert get_model_class([arch]).__name__ == cls


def test_prefill_logits_match_hf(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=1)
    hidden, _ = Harness(pair.ours).step([(Seq(prompt), PROMPT_LEN)])
    with torch.inference_mode():
        logits = pair.ours.compute_logits(hidden)
    assert logits.shape == (PROMPT_LEN, _COMMON["vocab_size"])
    torch.testing.assert_close(logits, _hf_logits(pair.hf, prompt), atol=ATOL, rtol=ATOL)


def test_greedy_tokens_match_hf_generate(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=2)
    gen_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    pair.hf.generation_config.eos_token_id = None  # else HF fills the config's EOS back in
    with torch.inference_mode():
        expected = pair.hf.generate(torch.tensor([prompt]), generation_config=gen_config)
    expected_new = expected[0, PROMPT_LEN:].tolist()
    assert len(expected_new) == NUM_NEW_TOKENS
    harness = Harness(pair.ours)
    seq = Seq(list(prompt))
    logits = harness.last_logits([(seq, PROMPT_LEN)])
    generated: list[int] = []
    while True:
        token = int(logits[0].argmax())
        generated.append(token)
        seq.tokens.append(token)
        if len(generated) == NUM_NEW_TOKENS:
            break
        logits = harness.last_logits([(seq, 1)])
    assert generated == expected_new


def test_chunked_prefill_and_mixed_batch_match_hf(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=3)
    reference = _hf_logits(pair.hf, prompt)
    harness = Harness(pair.ours)
    seq = Seq(prompt)
    for start in range(0, PROMPT_LEN, 5):
        logits = harness.last_logits([(seq, 5)])[0]
        torch.testing.assert_close(logits, reference[start + 4], atol=ATOL, rtol=ATOL)
    prompt_a, prompt_b, prompt_c = _prompt(7, seed=4), _prompt(12, seed=5), _prompt(15, seed=6)
    for model in (pair.ours, pair.native):
        harness = Harness(model)
        seq_a, seq_b, seq_c = Seq(prompt_a), Seq(prompt_b), Seq(prompt_c)
        harness.step([(seq_b, 11), (seq_c, 6)])
        logits = harness.last_logits([(seq_a, 7), (seq_b, 1), (seq_c, 9)])
        for row, p in enumerate((prompt_a, prompt_b, prompt_c)):
            torch.testing.assert_close(
                logits[row], _hf_logits(pair.hf, p)[-1], atol=ATOL, rtol=ATOL
            )


def test_moe_gguf_files_are_refused_in_one_line(tmp_path: Path) -> None:
    """GGUF MoE files we do not load: Mixtral's (arch "llama" with expert tensors) are refused
    clearly, not loaded as something else (Qwen2/3-MoE files load:
    tests/loader/test_gguf_families.py; DeepSeek-V2/V3's: test_gguf_deepseek_glm4.py)."""
    import gguf

    from model_server.loader import ModelLoadError, load_model_source

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 16).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(path))
    message = str(info.value)
    assert "\n" not in message and "8 experts" in message
