"""Parity of the Llama-family model with HF transformers on tiny random configs.

Every supported architecture (and the rope / bias / tying variants) is saved by HF as a real
safetensors folder, loaded into our model through `load_weights`, and run through the paged path
(block_size 4, scrambled block ids) with the portable torch attention backend:
  - prefill logits close to HF's at every position,
  - 32 greedy tokens identical to `hf_model.generate`,
  - chunked prefill (chunks of 5) and a mixed batch (prefill + decode + chunk after a cached
    prefix, in one forward) matching HF's per-sequence logits.
The same weights also run on the CPU platform's kernels (native norms, SiLU-and-mul, rotary and
paged attention with its KV store): the same logits to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from model_server.engine.execution.input_batch import ModelInputs, SeqChunk, build_model_inputs
from model_server.layers.attention import get_attention_backend
from model_server.layers.rotary import compute_inv_freq, rope_parameters_from_config
from model_server.models import (
    SUPPORTED_ARCHITECTURES,
    build_model,
    get_model_class,
    init_dummy_weights,
)
from model_server.platforms.cpu import CpuPlatform

BLOCK_SIZE = 4
NUM_BLOCKS = 48
MAX_MODEL_LEN = 128
VOCAB = 256
PROMPT_LEN = 20
NUM_NEW_TOKENS = 32
ATOL = 1e-4

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_MODEL_LEN,
    initializer_range=0.05,  # less flat logits than 0.02: no near-ties in greedy decoding
    tie_word_embeddings=False,
)

# name -> tiny HF config; together they cover every registered architecture.
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama_mha": lambda: transformers.LlamaConfig(**{**_COMMON, "num_key_value_heads": 4}),
    "llama_gqa_bias": lambda: transformers.LlamaConfig(
        **_COMMON, attention_bias=True, mlp_bias=True
    ),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,  # wavelengths 6.3 (kept), 19.9 (smoothed), 63+ (scaled)
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **_COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
    # SmolLM2-like: tied embeddings, one KV head.
    "llama_tied_mqa": lambda: transformers.LlamaConfig(
        **{**_COMMON, "tie_word_embeddings": True, "num_key_value_heads": 1}
    ),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(**_COMMON),
    # head_dim 32 with 4 heads: q is 128 wide while hidden is 64.
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32),
}


@dataclass
class Pair:
    hf: nn.Module
    ours: nn.Module
    config: transformers.PretrainedConfig
    # The same weights on the CPU platform's kernel table and the native "cpu" attention.
    native: nn.Module


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval()
    with torch.no_grad():
        # HF inits biases to 0 and norms to 1: perturb them so loading them is really tested.
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    config = transformers.AutoConfig.from_pretrained(folder)
    ours = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    loaded = ours.load_weights(load_file(folder / "model.safetensors").items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    native = build_model(
        config,
        get_attention_backend("cpu"),
        max_model_len=MAX_MODEL_LEN,
        kernels=CpuPlatform().kernel_table(),
    )
    native.load_weights(load_file(folder / "model.safetensors").items())
    return Pair(hf=hf, ours=ours, config=config, native=native)


@dataclass
class Seq:
    tokens: list[int]
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedHarness:
    """Drives our model through the paged KV cache the way the model runner does, with block
    ids handed out by hand (in a scrambled order, so sequences own non-contiguous blocks)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kv_caches = [
            torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
            for _ in range(model.num_layers)
        ]
        gen = torch.Generator().manual_seed(0)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()

    def step(self, work: list[tuple[Seq, int]]) -> tuple[torch.Tensor, ModelInputs]:
        """Compute the next `n` tokens of each (seq, n); returns hidden [T, hidden] (batch
        order) and the inputs."""
        chunks = []
        for seq, n in work:
            end = seq.num_computed + n
            assert end <= len(seq.tokens)
            while len(seq.block_ids) * BLOCK_SIZE < end:
                seq.block_ids.append(self.free_blocks.pop())
            chunks.append(
                SeqChunk(seq.tokens[seq.num_computed : end], seq.num_computed, list(seq.block_ids))
            )
        inputs = build_model_inputs(chunks, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        for seq, n in work:
            seq.num_computed += n
        return hidden, inputs

    def last_logits(self, work: list[tuple[Seq, int]]) -> torch.Tensor:
        """[len(work), vocab] logits of each chunk's last token, in the order of `work`."""
        hidden, inputs = self.step(work)
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[inputs.last_token_indices])
        out = torch.empty_like(logits)
        out[torch.tensor(inputs.order)] = logits
        return out


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=gen).tolist()


def _hf_logits(hf: nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def test_prefill_logits_match_hf(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=1)
    harness = PagedHarness(pair.ours)
    hidden, _ = harness.step([(Seq(prompt), PROMPT_LEN)])
    with torch.inference_mode():
        logits = pair.ours.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert logits.shape == (PROMPT_LEN, VOCAB)
    torch.testing.assert_close(logits, _hf_logits(pair.hf, prompt), atol=ATOL, rtol=ATOL)


def test_greedy_tokens_match_hf_generate(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=2)
    gen_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        expected = pair.hf.generate(torch.tensor([prompt]), generation_config=gen_config)
    expected_new = expected[0, PROMPT_LEN:].tolist()
    assert len(expected_new) == NUM_NEW_TOKENS

    harness = PagedHarness(pair.ours)
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


def test_chunked_prefill_matches_whole(pair: Pair) -> None:
    prompt = _prompt(PROMPT_LEN, seed=3)
    reference = _hf_logits(pair.hf, prompt)
    whole = PagedHarness(pair.ours).last_logits([(Seq(prompt), PROMPT_LEN)])[0]

    harness = PagedHarness(pair.ours)
    seq = Seq(prompt)
    for start in range(0, PROMPT_LEN, 5):
        logits = harness.last_logits([(seq, 5)])[0]
        # Each chunk's last token already sees the cached earlier chunks.
        torch.testing.assert_close(logits, reference[start + 4], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(logits, whole, atol=1e-5, rtol=1e-5)


def test_mixed_batch_matches_per_sequence(pair: Pair) -> None:
    prompt_a, prompt_b, prompt_c = _prompt(7, seed=4), _prompt(12, seed=5), _prompt(15, seed=6)
    harness = PagedHarness(pair.ours)
    seq_a, seq_b, seq_c = Seq(prompt_a), Seq(prompt_b), Seq(prompt_c)
    # Earlier step: B's prompt but its last token, and C's first 6 tokens (two prefills).
    harness.step([(seq_b, 11), (seq_c, 6)])
    # This step, in one forward: A's whole prompt, B decoding one token, C's remaining chunk.
    logits = harness.last_logits([(seq_a, 7), (seq_b, 1), (seq_c, 9)])
    for row, prompt in enumerate((prompt_a, prompt_b, prompt_c)):
        expected = _hf_logits(pair.hf, prompt)[-1]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=ATOL)


def test_native_cpu_kernels_match_portable_and_hf(pair: Pair) -> None:
    """A prefill, then a mixed step (a fresh prompt, a decode, a chunk after a cached prefix) on
    the CPU platform's kernels: HF's logits, and the portable path's to fp32 rounding."""
    prompt_a, prompt_b, prompt_c = _prompt(7, seed=7), _prompt(12, seed=8), _prompt(15, seed=9)
    logits = {}
    for name, model in (("ours", pair.ours), ("native", pair.native)):
        harness = PagedHarness(model)
        seq_a, seq_b, seq_c = Seq(prompt_a), Seq(prompt_b), Seq(prompt_c)
        harness.step([(seq_b, 11), (seq_c, 6)])
        logits[name] = harness.last_logits([(seq_a, 7), (seq_b, 1), (seq_c, 9)])
    torch.testing.assert_close(logits["native"], logits["ours"], atol=1e-5, rtol=1e-5)
    for row, prompt in enumerate((prompt_a, prompt_b, prompt_c)):
        expected = _hf_logits(pair.hf, prompt)[-1]
        torch.testing.assert_close(logits["native"][row], expected, atol=ATOL, rtol=ATOL)


# ---- loading, registry and rope edge cases (one tiny config, no HF reference needed) ----


def _tiny_llama_config(**overrides: object) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(**{**_COMMON, **overrides})
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def test_registry_lists_supported_architectures() -> None:
    assert set(SUPPORTED_ARCHITECTURES) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
    assert get_model_class(["Qwen3ForCausalLM"]).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel; supported"):
        get_model_class(["GPT2LMHeadModel"])


def test_load_weights_reports_missing_and_unexpected() -> None:
    model = build_model(_tiny_llama_config(), get_attention_backend("torch"))
    q_only = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(4 * 16, 64))]
    with pytest.raises(ValueError, match=r"missing weights for: .*qkv_proj.weight.*only shards"):
        model.load_weights(q_only)
    with pytest.raises(ValueError, match=r"model\.bogus\.weight matches no parameter"):
        model.load_weights([("model.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_load_weights_accepts_prefused_names() -> None:
    """A checkpoint already holding qkv_proj / gate_up_proj (our own state dict) loads as is."""
    source = build_model(_tiny_llama_config(), get_attention_backend("torch"))
    init_dummy_weights(source, seed=3)
    target = build_model(_tiny_llama_config(), get_attention_backend("torch"))
    target.load_weights(source.state_dict().items())
    expected = source.state_dict()
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_dummy_weights_and_bf16_build() -> None:
    config = _tiny_llama_config(tie_word_embeddings=True)
    model = build_model(config, get_attention_backend("torch"), dtype=torch.bfloat16)
    init_dummy_weights(model, seed=7)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert torch.get_default_dtype() == torch.float32  # build_model restored it
    harness = PagedHarness(model)
    harness.kv_caches = [c.to(torch.bfloat16) for c in harness.kv_caches]
    logits = harness.last_logits([(Seq(_prompt(6, seed=8)), 6)])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()  # the model's dtype


def test_rope_config_conventions() -> None:
    # transformers < 5: rope_theta and rope_scaling as separate attributes, "type" key.
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters_from_config(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500000.0
    plain = rope_parameters_from_config(SimpleNamespace(rope_theta=1e5, rope_scaling=None))
    assert plain == {"rope_theta": 1e5, "rope_type": "default"}
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        compute_inv_freq(16, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
