"""Parity of the families from the vLLM-GCU / candle-vllm model tables: StarCoder2, GLM-4 in its
`-hf` layout (`GlmForCausalLM`) and DBRX against transformers' own implementations, and the
remote-code families (InternLM2, Baichuan2-7B, ChatGLM2/3) against the transformers model their
math equals, on tiny random configs.

The remote-code checkpoints cannot be built with their own code (not in transformers; nothing is
downloaded): each is written by converting a transformers reference model's state dict into the
remote layout (InternLM2's per-KV-group `wqkv`, Baichuan's `W_pack` and an unnormalised NormHead,
ChatGLM's `query_key_value` and `dense_h_to_4h`) next to a config.json in the remote format, then
read back through the HF folder loader (which translates the config) and `load_weights`. Equal
logits to the reference prove the renames, splits and permutations (and the config
translation); they do not prove that the reference is what the remote code computes, which
rests on reading that code (models/remote_code.py's docstring).

The checks are test_parity_tiny.py's (imported, run on this module's `pair`): prefill logits,
32 greedy tokens equal to `generate`, chunked prefill, a mixed batch, and the CPU platform's
kernels with the "cpu" attention backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from model_server.layers.attention import get_attention_backend
from model_server.loader.hf_loader import load_hf_tokenizer, read_hf_config
from model_server.loader.source import ModelLoadError
from model_server.models import build_model, get_model_class
from model_server.platforms.cpu import CpuPlatform
from tests.models.test_parity_tiny import (  # noqa: F401  (tests collected here too)
    ATOL,
    MAX_MODEL_LEN,
    PROMPT_LEN,
    VOCAB,
    PagedHarness,
    Pair,
    Seq,
    _hf_logits,
    _prompt,
    test_chunked_prefill_matches_whole,
    test_greedy_tokens_match_hf_generate,
    test_mixed_batch_matches_per_sequence,
    test_native_cpu_kernels_match_portable_and_hf,
    test_prefill_logits_match_hf,
)

WINDOW = 8
_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_MODEL_LEN,
    initializer_range=0.05,
)
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _dbrx() -> transformers.PretrainedConfig:
    return transformers.DbrxConfig(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=MAX_MODEL_LEN,
        vocab_size=VOCAB,
        initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        # clip_qkv small enough to clamp (q/k/v reach ~0.5 with these weights).
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.25, "rope_theta": 5000.0},
        ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
        **_TOKENS,
    )


# name -> the transformers model's config (HF's own implementation of the family).
HF_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # A window smaller than the prompts on every layer; biases; tied LM head (its default).
    "starcoder2": lambda: transformers.Starcoder2Config(**_SIZES, sliding_window=WINDOW, **_TOKENS),
    "starcoder2_untied_no_bias": lambda: transformers.Starcoder2Config(
        **_SIZES, use_bias=False, tie_word_embeddings=False, hidden_act="gelu", **_TOKENS
    ),
    "glm": lambda: transformers.GlmConfig(
        **_SIZES, head_dim=16, partial_rotary_factor=0.5, attention_bias=True, **_TOKENS
    ),
    "dbrx": _dbrx,
}


# ---- remote layouts written from a reference transformers model ----------------------------


def _internlm2(sd: dict[str, torch.Tensor], cfg: transformers.PretrainedConfig) -> dict:
    """Llama names -> InternLM2's; q/k/v into `wqkv` grouped per KV head."""
    kv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_attention_heads // kv
    out = {}
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k = sd[name.replace("q_proj", "k_proj")]
            v = sd[name.replace("q_proj", "v_proj")]
            rest = t.shape[1:]
            packed = torch.cat(
                (
                    t.reshape(kv, groups, d, *rest),
                    k.reshape(kv, 1, d, *rest),
                    v.reshape(kv, 1, d, *rest),
                ),
                dim=1,
            )
            out[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = packed.reshape(-1, *rest)
            continue
        for old, new in (
            ("model.embed_tokens.", "model.tok_embeddings."),
            (".self_attn.o_proj.", ".attention.wo."),
            (".mlp.gate_proj.", ".feed_forward.w1."),
            (".mlp.up_proj.", ".feed_forward.w3."),
            (".mlp.down_proj.", ".feed_forward.w2."),
            (".input_layernorm.", ".attention_norm."),
            (".post_attention_layernorm.", ".ffn_norm."),
            ("lm_head.", "output."),
        ):
            name = name.replace(old, new)
        out[name] = t
    return out


def _internlm2_json(cfg: transformers.PretrainedConfig) -> dict:
    return {
        "architectures": ["InternLM2ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"},
        "model_type": "internlm2",
        "bias": True,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "rope_scaling": None,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **_TOKENS,
    }


def _baichuan(sd: dict[str, torch.Tensor], cfg: transformers.PretrainedConfig) -> dict:
    """Llama names -> Baichuan's: q/k/v stacked in `W_pack`; the head's rows rescaled (NormHead
    checkpoints store them unnormalised; the reference's are unit rows)."""
    out = {}
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k = sd[name.replace("q_proj", "k_proj")]
            v = sd[name.replace("q_proj", "v_proj")]
            out[name.replace(".q_proj.", ".W_pack.")] = torch.cat((t, k, v))
            continue
        if name == "lm_head.weight":
            gen = torch.Generator().manual_seed(5)
            t = t * (0.5 + 2 * torch.rand(t.shape[0], 1, generator=gen))
        out[name] = t
    return out


def _baichuan_json(cfg: transformers.PretrainedConfig) -> dict:
    return {
        "architectures": ["BaichuanForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig"},
        "model_type": "baichuan",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "max_position_embeddings": cfg.max_position_embeddings,
        "model_max_length": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "z_loss_weight": 0,
        **_TOKENS,
    }


def _chatglm(multi_query: bool) -> Callable[[dict, transformers.PretrainedConfig], dict]:
    def convert(sd: dict[str, torch.Tensor], cfg: transformers.PretrainedConfig) -> dict:
        """GLM -hf names -> ChatGLM's: q/k/v into `query_key_value` (q | k | v, or per head
        q, k, v without multi-query), gate_up -> dense_h_to_4h, the `transformer.` tree."""
        heads, d = cfg.num_attention_heads, cfg.head_dim
        out = {"transformer.rotary_pos_emb.inv_freq": torch.ones(d // 4)}
        for name, t in sd.items():
            if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
                continue
            if ".self_attn.q_proj." in name:
                k = sd[name.replace("q_proj", "k_proj")]
                v = sd[name.replace("q_proj", "v_proj")]
                if multi_query:
                    t = torch.cat((t, k, v))
                else:
                    rest = t.shape[1:]
                    parts = [x.reshape(heads, 1, d, *rest) for x in (t, k, v)]
                    t = torch.cat(parts, dim=1).reshape(-1, *rest)
                name = name.replace(".self_attn.q_proj.", ".self_attention.query_key_value.")
            for old, new in (
                ("model.embed_tokens.", "transformer.embedding.word_embeddings."),
                ("model.norm.", "transformer.encoder.final_layernorm."),
                ("model.layers.", "transformer.encoder.layers."),
                ("lm_head.", "transformer.output_layer."),
                (".self_attn.o_proj.", ".self_attention.dense."),
                (".mlp.gate_up_proj.", ".mlp.dense_h_to_4h."),
                (".mlp.down_proj.", ".mlp.dense_4h_to_h."),
            ):
                name = name.replace(old, new)
            out[name] = t
        return out

    return convert


def _chatglm_json(multi_query: bool) -> Callable[[transformers.PretrainedConfig], dict]:
    def make(cfg: transformers.PretrainedConfig) -> dict:
        return {
            "architectures": ["ChatGLMModel"],
            "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"},
            "model_type": "chatglm",
            "add_bias_linear": False,
            "add_qkv_bias": True,
            "apply_query_key_layer_scaling": True,
            "apply_residual_connection_post_layernorm": False,
            "attention_softmax_in_fp32": True,
            "ffn_hidden_size": cfg.intermediate_size,
            "fp32_residual_connection": False,
            "hidden_size": cfg.hidden_size,
            "kv_channels": cfg.head_dim,
            "layernorm_epsilon": cfg.rms_norm_eps,
            "multi_query_attention": multi_query,
            "multi_query_group_num": cfg.num_key_value_heads,
            "num_attention_heads": cfg.num_attention_heads,
            "num_layers": cfg.num_hidden_layers,
            "original_rope": True,
            "padded_vocab_size": cfg.vocab_size,
            "post_layer_norm": True,
            "rmsnorm": True,
            "rope_ratio": 50,
            "seq_length": cfg.max_position_embeddings,
            "tie_word_embeddings": False,
            **_TOKENS,
        }

    return make


def _glm_ref(kv_heads: int) -> Callable[[], transformers.PretrainedConfig]:
    return lambda: transformers.GlmConfig(
        **{**_SIZES, "num_key_value_heads": kv_heads},
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        rope_theta=10000.0 * 50,  # ChatGLM's base is 10000 * rope_ratio
        **_TOKENS,
    )


@dataclass
class Remote:
    reference: Callable[[], transformers.PretrainedConfig]
    convert: Callable[[dict[str, torch.Tensor], transformers.PretrainedConfig], dict]
    config_json: Callable[[transformers.PretrainedConfig], dict]
    normalize_head: bool = False


REMOTE: dict[str, Remote] = {
    "internlm2": Remote(
        lambda: transformers.LlamaConfig(
            **_SIZES, attention_bias=True, rope_theta=1e6, tie_word_embeddings=False, **_TOKENS
        ),
        _internlm2,
        _internlm2_json,
    ),
    "baichuan2_7b": Remote(
        lambda: transformers.LlamaConfig(
            **{**_SIZES, "num_key_value_heads": 4}, tie_word_embeddings=False, **_TOKENS
        ),
        _baichuan,
        _baichuan_json,
        normalize_head=True,
    ),
    "chatglm3_multi_query": Remote(_glm_ref(2), _chatglm(True), _chatglm_json(True)),
    "chatglm_multi_head": Remote(_glm_ref(4), _chatglm(False), _chatglm_json(False)),
}


def _perturbed(config: transformers.PretrainedConfig) -> nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # HF inits biases to 0 and norms to 1: perturb them so loading them is tested.
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    hf.generation_config.eos_token_id = None  # else generate stops or fills EOS back in
    return hf


def _write_remote(spec: Remote, folder: Path) -> nn.Module:
    config = spec.reference()
    hf = _perturbed(config)
    if spec.normalize_head:
        with torch.no_grad():
            hf.lm_head.weight.copy_(nn.functional.normalize(hf.lm_head.weight, dim=-1))
    state = {n: t.detach().clone().contiguous() for n, t in hf.state_dict().items()}
    save_file(spec.convert(state, config), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(spec.config_json(config)))
    return hf


@pytest.fixture(scope="module", params=[*HF_CONFIGS, *REMOTE])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    name = request.param
    folder: Path = tmp_path_factory.mktemp(name)
    if name in REMOTE:
        hf = _write_remote(REMOTE[name], folder)
        config = read_hf_config(str(folder))  # the loader's translation of config.json
    else:
        hf = _perturbed(HF_CONFIGS[name]())
        hf.save_pretrained(folder, safe_serialization=True)
        config = transformers.AutoConfig.from_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    ours = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    loaded = ours.load_weights(weights.items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    native = build_model(
        config,
        get_attention_backend("cpu"),
        max_model_len=MAX_MODEL_LEN,
        kernels=CpuPlatform().kernel_table(),
    )
    native.load_weights(weights.items())
    return Pair(hf=hf, ours=ours, config=config, native=native)


# ---- registry, refusals, config details (no reference model needed) ------------------------


def test_registry_maps_the_new_architectures() -> None:
    expected = {
        "Starcoder2ForCausalLM": "Starcoder2ForCausalLM",
        "GlmForCausalLM": "GlmForCausalLM",
        "DbrxForCausalLM": "DbrxForCausalLM",
        "InternLM2ForCausalLM": "InternLM2ForCausalLM",
        "BaichuanForCausalLM": "BaichuanForCausalLM",
        "BaiChuanForCausalLM": "BaichuanForCausalLM",
        "ChatGLMModel": "ChatGLMForCausalLM",
        "ChatGLMForConditionalGeneration": "ChatGLMForCausalLM",
    }
    for arch, cls in expected.items():
        assert get_model_class([arch]).__name__ == cls


def _remote_config(tmp_path: Path, data: dict) -> transformers.PretrainedConfig:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return read_hf_config(str(tmp_path))


def test_baichuan_13b_alibi_is_refused(tmp_path: Path) -> None:
    """Baichuan(2)-13B's config.json: hidden 5120, model_max_length but no
    max_position_embeddings (ALiBi, not rotary)."""
    data = _baichuan_json(REMOTE["baichuan2_7b"].reference())
    del data["max_position_embeddings"]
    config = _remote_config(tmp_path, data)
    with pytest.raises(ValueError, match="ALiBi"):
        build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="ALiBi"):
        get_model_class(config.architectures).check_tensor_parallel(config, 2)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("rmsnorm", False, "LayerNorm"),
        ("apply_residual_connection_post_layernorm", True, "post-layernorm"),
        ("post_layer_norm", False, "final layer norm"),
        ("add_bias_linear", True, "add_bias_linear"),
        ("pre_seq_len", 16, "prefix encoder"),
    ],
)
def test_chatglm_variants_wick_cannot_serve_are_refused(
    tmp_path: Path, key: str, value: object, match: str
) -> None:
    data = {**_chatglm_json(True)(_glm_ref(2)()), key: value}
    config = _remote_config(tmp_path, data)
    with pytest.raises(ValueError, match=match):
        build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)


def test_chatglm2_32k_and_chatglm_v1_are_refused(tmp_path: Path) -> None:
    """ChatGLM2-6B-32k divides positions by rope_ratio (ChatGLM3 / GLM-4 multiply the base):
    refused where the folder says chatglm2. The first ChatGLM-6B (2D positions) is refused."""
    folder = tmp_path / "chatglm2-6b-32k"
    folder.mkdir()
    config = _remote_config(folder, _chatglm_json(True)(_glm_ref(2)()))  # rope_ratio 50
    with pytest.raises(ValueError, match="ChatGLM2-6B-32k interpolates positions"):
        build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    v1 = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 64,
          "num_layers": 2, "vocab_size": VOCAB, "position_encoding_2d": True}  # fmt: skip
    with pytest.raises(ValueError, match="first ChatGLM-6B"):
        _remote_config(tmp_path, v1)


def test_internlm2_dynamic_ntk_is_plain_rope_within_max_position(tmp_path: Path) -> None:
    """InternLM2.5's dynamic NTK rope changes the base only beyond max_position_embeddings:
    within it the model is the plain-rope one (same logits); a longer max_model_len is refused,
    as is a rope type Wick does not implement."""
    spec = REMOTE["internlm2"]
    hf = _write_remote(spec, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = read_hf_config(str(tmp_path))
    model = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    model.load_weights(load_file(tmp_path / "model.safetensors").items())
    prompt = _prompt(PROMPT_LEN, seed=1)
    hidden, _ = PagedHarness(model).step([(Seq(prompt), PROMPT_LEN)])
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match=r"dynamic NTK .* at most max_position_embeddings"):
        build_model(config, get_attention_backend("torch"), max_model_len=2 * MAX_MODEL_LEN)
    data["rope_scaling"] = {"type": "yarn", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        build_model(
            read_hf_config(str(tmp_path)),
            get_attention_backend("torch"),
            max_model_len=MAX_MODEL_LEN,
        )


def test_chatglm_config_translation(tmp_path: Path) -> None:
    config = _remote_config(tmp_path, _chatglm_json(True)(_glm_ref(2)()))
    assert config.architectures == ["ChatGLMModel"]
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (2, 16, VOCAB)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert config.rope_parameters["partial_rotary_factor"] == 0.5


def test_dbrx_rope_base_is_attn_config_rope_theta() -> None:
    """DBRX's config.json keeps the base in attn_config (500000); transformers 5's
    rope_parameters says 10000 for such a config. The checkpoint's own value wins."""
    config = transformers.DbrxConfig(
        d_model=64,
        n_heads=4,
        n_layers=1,
        vocab_size=VOCAB,
        attn_config={"kv_n_heads": 2, "rope_theta": 500000},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1},
    )
    config.architectures = ["DbrxForCausalLM"]
    assert config.rope_parameters["rope_theta"] == 10000.0
    model = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    rope = model.model.rotary_emb
    inv_freq_1 = 500000.0 ** (-2 / 16)  # head_dim 16: the second frequency
    cos_sin = rope.cos_sin_cache[1]  # position 1: cos(inv_freq) ..., sin(inv_freq) ...
    assert cos_sin[1].item() == pytest.approx(torch.cos(torch.tensor(inv_freq_1)).item())


def test_new_families_split_for_tensor_parallelism() -> None:
    for make, arch in (
        (HF_CONFIGS["starcoder2"], "Starcoder2ForCausalLM"),
        (HF_CONFIGS["glm"], "GlmForCausalLM"),
        (_dbrx, "DbrxForCausalLM"),
    ):
        config = make()
        config.architectures = [arch]
        get_model_class([arch]).check_tensor_parallel(config, 2)
    config = _dbrx()
    config.ffn_config.ffn_hidden_size = 47
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        get_model_class(["DbrxForCausalLM"]).check_tensor_parallel(config, 2)


def test_remote_family_tokenizer_comes_from_tokenizer_json(tmp_path: Path) -> None:
    """The remote tokenizer class is never run: tokenizer.json (with tokenizer_config.json's
    special tokens and chat template) is used, and without one the error says so."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = _remote_config(tmp_path, _internlm2_json(REMOTE["internlm2"].reference()))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "InternLM2Tokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]},
                "eos_token": "b",
                "chat_template": "{{ messages[0].content }}",
            }
        )
    )
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece model")
    with pytest.raises(ModelLoadError, match="remote code, which Wick does not run"):
        load_hf_tokenizer(str(tmp_path), config)
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_hf_tokenizer(str(tmp_path), config)
    assert tokenizer("a b a").input_ids == [0, 1, 0]
    assert tokenizer.eos_token_id == 1
    assert tokenizer.chat_template == "{{ messages[0].content }}"
