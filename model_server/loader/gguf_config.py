"""An HF config rebuilt from GGUF metadata (llama.cpp key names, prefixed by the architecture)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from model_server.loader.dequant import UNQUANTIZED, stored_dtype
from model_server.loader.gguf_file import GGUFFile, GGUFTensorInfo
from model_server.loader.hf_loader import set_config_dtype
from model_server.loader.source import ModelLoadError

if TYPE_CHECKING:
    import torch
    import transformers

# general.architecture -> (HF model_type, HF architectures entry)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    # The families beyond Llama (models/): llama.cpp's names, the config keys each needs added
    # by _FAMILY_CONFIG below, tensor names by gguf_loader's per-architecture maps.
    "phi2": ("phi", "PhiForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "stablelm": ("stablelm", "StableLmForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4": ("glm4", "Glm4ForCausalLM"),
    # DeepSeek-V2 and V3 share one llama.cpp architecture: _deepseek2 tells them apart by the
    # router's gating function (V3: sigmoid).
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
}
# Architectures whose files hold experts (stacked `ffn_*_exps` tensors) that we load.
_MOE_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe", "deepseek2"})
# gguf.ExpertGatingFuncType: llama.cpp's default for files without the key is softmax.
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
# llama.cpp's Gemma 3 converter keeps neither the local layers' rope base nor their pattern in
# the file (its runtime hard-codes both): HF's values for every released Gemma 3.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_PATTERN = 6


def gguf_hf_config(gf: GGUFFile) -> transformers.PretrainedConfig:
    """The HF config the file describes; raises ModelLoadError for a missing key or an
    architecture outside GGUF_ARCHITECTURES."""
    import transformers

    arch = gf.architecture
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{gf.path}: GGUF architecture {arch!r} is not supported (supported: {supported})"
        )
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    md = gf.metadata
    tensors = {t.name: t for t in gf.tensors}

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in md:
            return md[full]
        if default is ...:
            raise ModelLoadError(f"{gf.path}: GGUF metadata has no {full}")
        return default

    # Mixtral GGUFs are arch "llama" with stacked expert tensors
    if key("expert_count", 0) and arch not in _MOE_ARCHITECTURES:
        raise ModelLoadError(
            f"{gf.path}: mixture-of-experts GGUF files ({key('expert_count')} experts) are not "
            "supported: load the model's Hugging Face safetensors folder"
        )
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = _uniform(gf.path, "attention.head_count_kv", key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gf.path}: GGUF file has no token_embd.weight tensor")
    # The embedding's row count is authoritative; metadata vocab_size is optional and can lag.
    vocab_size = embed.shape[0]

    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        # Multi-token-prediction layers (GLM-OCR, DeepSeek-V3.2 files) follow the decoder's.
        "num_hidden_layers": int(key("block_count")) - int(key("nextn_predict_layers", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(md),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }
    if model_type != "qwen2":  # Qwen2 always has q/k/v biases; the others say so in the config
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    rope_scaling = _rope_scaling(gf, arch, head_dim, kwargs["rope_theta"], tensors)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch in _FAMILY_CONFIG:
        variant = _FAMILY_CONFIG[arch](gf, key, tensors, kwargs)
        if variant is not None:  # one llama.cpp architecture for several HF ones
            model_type, architecture = variant
            kwargs["architectures"] = [architecture]

    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._name_or_path = gf.path
    set_config_dtype(config, _checkpoint_dtype(gf.tensors))
    return config


def _uniform(path: str, name: str, value: Any) -> int:
    # Some files give a per-layer list; the engine supports one value for every layer.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{path}: per-layer {name} {value} is not supported")
        value = value[0]
    return int(value)


def _eos_ids(md: dict[str, Any]) -> int | list[int] | None:
    """EOS plus llama.cpp's end-of-turn / end-of-message ids when they differ (Llama 3 chat)."""
    ids: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = md.get(f"tokenizer.ggml.{k}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope_scaling(
    gf: GGUFFile, arch: str, head_dim: int, theta: float, tensors: dict[str, GGUFTensorInfo]
) -> dict[str, Any] | None:
    md = gf.metadata
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for beta in ("beta_fast", "beta_slow"):  # yarn's ramp ends, when not HF's 32 and 1
            value = md.get(f"{arch}.rope.scaling.yarn_{beta}")
            if kind == "yarn" and value:
                scaling[beta] = float(value)
        return scaling
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling(gf, tensors["rope_freqs.weight"], head_dim, theta)
    return None


def _llama3_scaling(
    gf: GGUFFile, info: GGUFTensorInfo, head_dim: int, theta: float
) -> dict[str, Any]:
    """Llama 3.1+ files store the computed per-frequency rope factors, not the parameters.

    Recover them: the largest factor is `factor`; the others are Meta's published constants,
    checked by recomputing the factors the way llama.cpp's converter does.
    """
    from model_server.loader.dequant import dequantize

    stored = dequantize(gf.tensor_data(info), info.ggml_type, info.shape).float().tolist()
    factor = max(stored)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_factors(head_dim, theta, scaling)
    if len(expected) != len(stored) or not all(
        math.isclose(a, b, rel_tol=1e-3) for a, b in zip(expected, stored, strict=False)
    ):
        raise ModelLoadError(
            f"{gf.path}: rope_freqs.weight does not match Llama 3 rope scaling "
            f"(factor {factor}, low 1, high 4, original context 8192); not supported"
        )
    return scaling


def _llama3_factors(head_dim: int, theta: float, s: dict[str, Any]) -> list[float]:
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return factors


def _checkpoint_dtype(tensors: list[GGUFTensorInfo]) -> torch.dtype | None:
    """The float type a fully unquantized file is written in; None when any matrix is quantized.

    Norms are F32 in every file, so only 2-D tensors decide.
    """
    matrices = [t.ggml_type for t in tensors if len(t.shape) == 2]
    if not matrices or any(t not in UNQUANTIZED for t in matrices):
        return None
    dtypes = {stored_dtype(t) for t in matrices}
    return dtypes.pop() if len(dtypes) == 1 else None


# ---- the families beyond Llama: config keys from each architecture's llama.cpp metadata --------

_Key = Any  # gguf_hf_config's `key(name, default)` reader


def _partial_rotary(key: _Key, kwargs: dict[str, Any]) -> None:
    """llama.cpp stores the rotated dims per head (rope.dimension_count), HF their fraction."""
    rotary = key("rope.dimension_count", kwargs["head_dim"])
    kwargs["partial_rotary_factor"] = int(rotary) / kwargs["head_dim"]


def _layer_norm(key: _Key, kwargs: dict[str, Any]) -> None:
    kwargs["layer_norm_eps"] = float(key("attention.layer_norm_epsilon", 1e-5))
    kwargs.pop("rms_norm_eps")


def _phi2(gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]) -> None:
    _partial_rotary(key, kw)
    _layer_norm(key, kw)


def _phi3(gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]) -> None:
    _partial_rotary(key, kw)
    kw["sliding_window"] = key("attention.sliding_window", None) or None
    if "rope_factors_long.weight" in tensors:  # LongRoPE: both factor sets stored as tensors
        from model_server.loader.dequant import dequantize

        factors = {}
        for kind in ("long", "short"):
            info = tensors.get(f"rope_factors_{kind}.weight")
            if info is None:
                raise ModelLoadError(f"{gf.path}: GGUF file has no rope_factors_{kind}.weight")
            data = dequantize(gf.tensor_data(info), info.ggml_type, info.shape)
            factors[f"{kind}_factor"] = data.float().tolist()
        original = int(key("rope.scaling.original_context_length", kw["max_position_embeddings"]))
        kw["original_max_position_embeddings"] = original
        kw["rope_scaling"] = {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": original,
        }


def _gemma(gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]) -> None:
    kw["hidden_activation"] = "gelu_pytorch_tanh"


def _query_pre_attn_scalar(key: _Key, kw: dict[str, Any], layers_27b: int) -> int:
    """`attention.scale` (the softmax scale, scalar^-1/2) where the file has it; llama.cpp's
    converter does not write it, and its runtime scales by hidden / heads for the 27B models
    (known by their layer count), by head_dim otherwise, as HF's released configs do."""
    scale = key("attention.scale", None)
    if scale:
        return round(float(scale) ** -2)
    if kw["num_hidden_layers"] == layers_27b:
        return kw["hidden_size"] // kw["num_attention_heads"]
    return kw["head_dim"]


def _gemma2(
    gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]
) -> None:
    _gemma(gf, key, tensors, kw)
    kw["sliding_window"] = int(key("attention.sliding_window"))
    kw["attn_logit_softcapping"] = key("attn_logit_softcapping", None)
    kw["final_logit_softcapping"] = key("final_logit_softcapping", None)
    kw["query_pre_attn_scalar"] = _query_pre_attn_scalar(key, kw, layers_27b=46)


def _gemma3(
    gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]
) -> None:
    _gemma(gf, key, tensors, kw)
    kw["sliding_window"] = int(key("attention.sliding_window"))
    kw["query_pre_attn_scalar"] = _query_pre_attn_scalar(key, kw, layers_27b=62)
    # Every 6th layer global; files that say otherwise give a per-layer list of booleans.
    pattern = key("attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    layers = kw["num_hidden_layers"]
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern][:layers]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    kw["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]
    full = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    scaling = kw.pop("rope_scaling", None)
    if scaling is not None:  # llama.cpp applies it to the global layers only, as HF does
        full.update(scaling)
    local = float(key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    kw["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }


def _stablelm(
    gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]
) -> None:
    if "blk.0.attn_q_norm.weight" in tensors:
        raise ModelLoadError(
            f"{gf.path}: StableLM with per-head q/k layer norms (qk_layernorm) is not supported "
            "from GGUF: load the model's Hugging Face safetensors folder"
        )
    _partial_rotary(key, kw)
    _layer_norm(key, kw)
    kw["use_parallel_residual"] = bool(key("use_parallel_residual", False))
    kw["use_qkv_bias"] = "blk.0.attn_q.bias" in tensors


def _qwen_moe(
    gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]
) -> None:
    kw["num_experts"] = int(key("expert_count"))
    kw["num_experts_per_tok"] = int(key("expert_used_count"))
    kw["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    kw["decoder_sparse_step"] = 1
    kw["mlp_only_layers"] = []
    kw["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if gf.architecture == "qwen2moe":
        kw["attention_bias"] = "blk.0.attn_output.bias" in tensors  # q/k/v biases only
        kw["norm_topk_prob"] = False  # Qwen1.5/2-MoE route on the unnormalised top-k
        shared = tensors.get("blk.0.ffn_gate_shexp.weight")
        size = key("expert_shared_feed_forward_length", shared.shape[0] if shared else 0)
        kw["shared_expert_intermediate_size"] = int(size)
    else:
        kw["norm_topk_prob"] = bool(key("expert_weights_norm", True))


def _glm4(gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]) -> None:
    # Stored as HF has it: llama.cpp's GLM-4 rope is the interleaved (GPT-J) one HF uses, so
    # its converter does not permute q/k (models/glm4.py makes the neox layout at load).
    _partial_rotary(key, kw)


def _deepseek2(
    gf: GGUFFile, key: _Key, tensors: dict[str, GGUFTensorInfo], kw: dict[str, Any]
) -> tuple[str, str]:
    """DeepSeek-V2 / V2-Lite / V3 / R1. Multi-head latent attention: llama.cpp's converter
    writes the file as MQA over the latent since it splits kv_b_proj (head_count_kv 1,
    key_length kv_lora_rank + rope dims, the real per-head sizes in key/value_length_mla);
    older files with one attn_kv_b have head_count_kv = heads and the per-head sizes in
    key/value_length. The rope dims are interleaved in the file as in HF's checkpoints (llama.cpp
    rotates adjacent pairs for deepseek2): nothing to un-permute."""
    heads = kw["num_attention_heads"]
    rope = int(key("rope.dimension_count"))
    qk_head_dim, v_head_dim = _mla_head_dims(key, tensors, heads, rope)
    kw.pop("head_dim")  # HF derives it (the rope dims)
    kw.update(
        num_key_value_heads=heads,
        q_lora_rank=int(key("attention.q_lora_rank", 0)) or None,  # V2-Lite: a plain q_proj
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=qk_head_dim - rope,
        v_head_dim=v_head_dim,
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors,
        n_routed_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        n_shared_experts=int(key("expert_shared_count", 0)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(key("expert_weights_scale", 0.0)) or 1.0,
        # written only when true by today's converter
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=int(key("expert_group_count", 1)),
        topk_group=int(key("expert_group_used_count", 1)),
    )
    scaling = kw.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        # llama.cpp keeps only 0.1 * mscale_all_dim (yarn_log_multiplier) and takes HF's mscale
        # to equal it (every released config): cos/sin unscaled, softmax scale times
        # mscale(factor, mscale_all_dim)^2. Without the key it scales neither.
        log_mul = key("rope.scaling.yarn_log_multiplier", None)
        if log_mul:
            scaling["mscale"] = scaling["mscale_all_dim"] = round(10 * float(log_mul), 6)
        else:
            scaling["attention_factor"] = 1.0
    gating = int(key("expert_gating_func", _GATING_SOFTMAX))
    has_bias = any(name.endswith(".exp_probs_b.bias") for name in tensors)
    if gating == _GATING_SIGMOID:  # V3: sigmoid scores, correction bias, grouped top-k
        return "deepseek_v3", "DeepseekV3ForCausalLM"
    if gating != _GATING_SOFTMAX or has_bias:
        raise ModelLoadError(
            f"{gf.path}: deepseek2 GGUF with expert_gating_func {gating}"
            f"{' and an expert correction bias (exp_probs_b)' if has_bias else ''} is not "
            "supported (DeepSeek-V2: softmax without a bias; V3: sigmoid with one)"
        )
    # V2: the groups (V2 and V2.5: 8, 3 used) limit the softmax top-k; V2-Lite has none
    kw["topk_method"] = "group_limited_greedy" if kw["n_group"] > 1 else "greedy"
    return "deepseek_v2", "DeepseekV2ForCausalLM"


def _mla_head_dims(
    key: _Key, tensors: dict[str, GGUFTensorInfo], heads: int, rope: int
) -> tuple[int, int]:
    """(qk_nope + qk_rope, v) per head: from key/value_length_mla (today's files), else from
    key/value_length (older ones), else from the tensors' shapes (q_b / q rows are heads x
    (nope + rope); kv_b's heads x (nope + v); attn_v_b is [heads, v, L])."""
    q = tensors.get("blk.0.attn_q_b.weight") or tensors.get("blk.0.attn_q.weight")
    kv_b, v_b = tensors.get("blk.0.attn_kv_b.weight"), tensors.get("blk.0.attn_v_b.weight")
    qk_head_dim = int(key("attention.key_length_mla", 0))
    if not qk_head_dim and q is not None and (kv_b is None and v_b is not None):
        qk_head_dim = q.shape[0] // heads  # split, yet no *_mla keys: key_length is the latent's
    if not qk_head_dim:
        qk_head_dim = int(key("attention.key_length", q.shape[0] // heads if q else ...))
    if v_b is not None:
        v_rows = v_b.shape[-2] if len(v_b.shape) == 3 else v_b.shape[0] // heads
        v_head_dim = int(key("attention.value_length_mla", v_rows))
    elif key("attention.value_length_mla", None) is not None:
        v_head_dim = int(key("attention.value_length_mla"))
    else:
        v_rows = kv_b.shape[0] // heads - (qk_head_dim - rope) if kv_b else ...
        v_head_dim = int(key("attention.value_length", v_rows))
    return qk_head_dim, v_head_dim


_FAMILY_CONFIG: dict[str, Any] = {
    "phi2": _phi2,
    "phi3": _phi3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "stablelm": _stablelm,
    "qwen2moe": _qwen_moe,
    "qwen3moe": _qwen_moe,
    "glm4": _glm4,
    "deepseek2": _deepseek2,
}
