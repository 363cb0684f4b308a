"""GGUF files of the families beyond Llama (Phi-2, Phi-3 with LongRoPE, Gemma 1/2/3, StableLM,
Qwen2-MoE, Qwen3-MoE), written with the gguf package's writer from tiny random HF models the way
llama.cpp's converter writes them: tensor names through gguf-py's own TensorNameMap for the
architecture, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, experts
stacked per projection, the metadata keys llama.cpp writes. Loaded through `load_model_source`,
the model built from the rebuilt config must give HF's prefill logits and 32 greedy tokens."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from model_server.layers.attention import get_attention_backend
from model_server.loader import ModelLoadError, load_model_source
from model_server.models import build_model
from tests.models import test_parity_tiny as tiny
from tests.models.test_parity_families import CONFIGS as FAMILY_CONFIGS
from tests.models.test_parity_moe import _MOE
from tests.models.test_parity_tiny import MAX_MODEL_LEN, Pair

# Our name -> (GGUF architecture, HF config).
CASES: dict[str, tuple[str, Callable[[], transformers.PretrainedConfig]]] = {
    "phi2": ("phi2", FAMILY_CONFIGS["phi2"]),
    "phi3_longrope_window": ("phi3", FAMILY_CONFIGS["phi3_longrope_window"]),
    "gemma": ("gemma", FAMILY_CONFIGS["gemma"]),
    "gemma2": ("gemma2", FAMILY_CONFIGS["gemma2"]),  # query_pre_attn_scalar 24: attention.scale
    "gemma3": ("gemma3", FAMILY_CONFIGS["gemma3"]),
    "stablelm_qkv_bias": ("stablelm", FAMILY_CONFIGS["stablelm_qkv_bias"]),
    "stablelm_parallel_residual": ("stablelm", FAMILY_CONFIGS["stablelm_parallel_residual"]),
    # llama.cpp's qwen2moe has every layer sparse: no mlp_only_layers.
    "qwen2moe": (
        "qwen2moe",
        lambda: transformers.Qwen2MoeConfig(
            **_MOE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    "qwen3moe": (
        "qwen3moe",
        lambda: transformers.Qwen3MoeConfig(
            **_MOE,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
}

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def _hf_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CASES[name][1]()).eval()
    with torch.no_grad():  # biases and norms away from HF's constants, so mix-ups show
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
    return hf


def _expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's experts (transformers 5's stacked gate_up / down, or one tensor per expert) as
    llama.cpp stacks them: one [num_experts, out, in] tensor per projection, under the HF-style
    name `...experts.<proj>.weight` that the name map below turns into `ffn_<proj>_exps`."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name in list(state):
        if m := _STACKED.match(name):
            tensor = state.pop(name)
            if m.group(2) == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                out[f"{m.group(1)}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.up_proj.weight"] = up
            else:
                out[f"{m.group(1)}.down_proj.weight"] = tensor
        elif m := _PER_EXPERT.match(name):
            per_expert.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = state.pop(name)
    for (prefix, proj), experts in per_expert.items():
        out[f"{prefix}.{proj}.weight"] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _gguf_name(tmap: gguf.TensorNameMap, name: str) -> str:
    for proj in ("gate", "up", "down"):  # stacked experts: llama.cpp's ffn_<proj>_exps
        if m := re.match(rf"^model\.layers\.(\d+)\.mlp\.experts\.{proj}_proj\.weight$", name):
            return f"blk.{m.group(1)}.ffn_{proj}_exps.weight"
    mapped = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert mapped is not None, f"gguf-py's name map has no {name}"
    return mapped


def _write_gguf(path: Path, arch: str, hf: torch.nn.Module) -> None:
    cfg = hf.config
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    state.update(_expert_tensors(state))
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if hasattr(cfg, "layer_norm_eps"):
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(head_dim * partial))
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        if cfg.query_pre_attn_scalar != head_dim:  # not llama.cpp's default: say it
            writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if arch == "stablelm":
        writer.add_parallel_residual(cfg.use_parallel_residual)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        else:
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
    tokens = ["<unk>", "<s>", "</s>", "ab"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # llama.cpp writes output.weight only when untied
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma converters store 1 + w
        writer.add_tensor(_gguf_name(tmap, name), np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(CASES))
def gguf_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = CASES[request.param][0]
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    _write_gguf(path, arch, hf)
    source = load_model_source(str(path))
    assert source.format == "gguf"
    config = source.hf_config
    assert config.architectures == [type(hf).__name__]
    ours = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    assert source.weights is not None
    loaded = ours.load_weights(source.weights())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return Pair(hf=hf, ours=ours, config=config, native=None), request.param


def test_gguf_prefill_logits_match_hf(gguf_pair) -> None:
    tiny.test_prefill_logits_match_hf(gguf_pair[0])


def test_gguf_greedy_tokens_match_hf(gguf_pair) -> None:
    tiny.test_greedy_tokens_match_hf_generate(gguf_pair[0])


def test_gguf_config_keeps_what_the_family_needs(gguf_pair) -> None:
    pair, name = gguf_pair
    ours, theirs = pair.config, pair.hf.config
    for field in (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "layer_types",
        "partial_rotary_factor",
        "use_parallel_residual",
        "use_qkv_bias",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
    ):
        if hasattr(theirs, field):
            assert getattr(ours, field) == getattr(theirs, field), (name, field)


def test_stablelm_with_qk_layernorm_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "stablelm.gguf"
    writer = gguf.GGUFWriter(str(path), "stablelm")
    writer.add_block_count(1)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q_norm.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="qk_layernorm") as info:
        load_model_source(str(path))
    assert "\n" not in str(info.value)


def _metadata_only(path: Path, arch: str, layers: int, extra: Callable[[gguf.GGUFWriter], None]):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_rope_freq_base(1e6)
    extra(writer)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma3_without_a_pattern_takes_every_sixth_layer_global(tmp_path: Path) -> None:
    """llama.cpp's Gemma 3 files carry the window but not the pattern nor the local rope base:
    HF's released values (every 6th layer global, local base 10000), the scalar head_dim."""
    from model_server.loader.gguf_config import gguf_hf_config
    from model_server.loader.gguf_file import read_gguf

    path = tmp_path / "gemma3.gguf"
    _metadata_only(path, "gemma3", 7, lambda w: w.add_sliding_window(512))
    config = gguf_hf_config(read_gguf(str(path)))
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 16
    rope = config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] == 10000.0
    assert rope["full_attention"]["rope_theta"] == 1e6
