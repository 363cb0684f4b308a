"""Checkpoints whose HF modeling code ships with the checkpoint (`trust_remote_code`; not in
transformers) and whose math is a family Wick already runs: their config.json is translated to
that family's transformers config and their tensors renamed / split onto its modules at load.
No remote code is run.

  - InternLM2 (`InternLM2ForCausalLM`, model_type internlm2) -> Llama: `tok_embeddings`,
    `attention.wqkv` (rows grouped per KV head: that head's q heads, then its k, then its v),
    `attention.wo`, `feed_forward.w1/w3/w2` (gate/up/down), `attention_norm`, `ffn_norm`,
    `output`; q/k/v/o biases when `bias`. Dynamic NTK rope scaling (InternLM2.5) is the plain
    rope up to `max_position_embeddings`, served up to there; a longer `max_model_len` is
    refused.
  - Baichuan 7B (`BaichuanForCausalLM`: Baichuan2-7B; `BaiChuanForCausalLM`: Baichuan-7B) ->
    Llama with rotary: `self_attn.W_pack` is q | k | v stacked; Baichuan2's NormHead (an LM head
    whose rows are L2-normalised before use) is normalised once at load. The 13B models
    use ALiBi instead of rotary and are refused (hidden_size 5120, or a config.json without
    `max_position_embeddings`: the rotary models' code reads it, the ALiBi models' has none).
  - ChatGLM2/3 and the remote-code GLM-4-9B (`ChatGLMModel`, model_type chatglm) -> GLM
    (`GlmForCausalLM`, models/glm4.py): `transformer.embedding.word_embeddings`,
    `encoder.layers.N.self_attention.query_key_value` (q | k | v with bias when multi-query,
    else per head q, k, v), `self_attention.dense`, `mlp.dense_h_to_4h` (gate | up) and
    `dense_4h_to_h`, `encoder.final_layernorm`, `output_layer`; interleaved rotary over half of
    each head with base 10000 * `rope_ratio` (ChatGLM3's and GLM-4's reading; ChatGLM2-6B-32k
    divides positions by it instead and is refused where its folder name says chatglm2; the
    first ChatGLM-6B's 2D positions are refused). LayerNorm variants (`rmsnorm` false), the
    post-layernorm residual, a missing final norm, linear biases and prefix tuning
    (`pre_seq_len`) are refused.

`translate_config` (the HF folder loader calls it before AutoConfig, which would need the remote
code) gives the equivalent transformers config with `architectures` and the original fields
kept (`remote_code_config`), so the registry picks the classes below. Their tokenizer classes
are remote code too: the loader reads the folder's tokenizer.json instead (loader/hf_loader.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import transformers
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.rotary import rope_parameters_from_config
from model_server.models.glm4 import GlmForCausalLM
from model_server.models.llama import LlamaForCausalLM

_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _common(data: dict[str, Any]) -> dict[str, Any]:
    kw = {k: data[k] for k in _TOKEN_FIELDS if data.get(k) is not None}
    dtype = data.get("torch_dtype") or data.get("dtype")
    if dtype:
        kw["dtype"] = dtype
    return kw


def _internlm2(data: dict[str, Any]) -> transformers.PretrainedConfig:
    scaling = data.get("rope_scaling") or {}
    rope = {"rope_type": scaling.get("type") or "default", "rope_theta": data["rope_theta"]}
    if scaling.get("factor") is not None:
        rope["factor"] = float(scaling["factor"])
    heads = data["num_attention_heads"]
    return transformers.LlamaConfig(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        intermediate_size=data["intermediate_size"],
        num_hidden_layers=data["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        hidden_act=data.get("hidden_act", "silu"),
        max_position_embeddings=data.get("max_position_embeddings", 2048),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        attention_bias=bool(data.get("bias", True)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        rope_parameters=rope,
        **_common(data),
    )


def _baichuan(data: dict[str, Any]) -> transformers.PretrainedConfig:
    heads = data["num_attention_heads"]
    max_len = data.get("max_position_embeddings") or data.get("model_max_length") or 4096
    return transformers.LlamaConfig(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        intermediate_size=data["intermediate_size"],
        num_hidden_layers=data["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        hidden_act=data.get("hidden_act", "silu"),
        max_position_embeddings=max_len,
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_common(data),
    )


def _chatglm(data: dict[str, Any]) -> transformers.PretrainedConfig:
    if data.get("position_encoding_2d") or "padded_vocab_size" not in data:
        raise ValueError(
            "chatglm: the first ChatGLM-6B (2D position encoding, GELU MLP) is not supported; "
            "ChatGLM2/3 and GLM-4 are"
        )
    heads = data["num_attention_heads"]
    kv_heads = data["multi_query_group_num"] if data.get("multi_query_attention") else heads
    return transformers.GlmConfig(
        vocab_size=data["padded_vocab_size"],
        hidden_size=data["hidden_size"],
        intermediate_size=data["ffn_hidden_size"],
        num_hidden_layers=data["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=data.get("kv_channels") or data["hidden_size"] // heads,
        partial_rotary_factor=0.5,
        rope_theta=10000.0 * float(data.get("rope_ratio") or 1.0),
        rms_norm_eps=data.get("layernorm_epsilon", 1e-5),
        max_position_embeddings=data.get("seq_length", 8192),
        attention_bias=bool(data.get("add_qkv_bias", False)),
        hidden_act="silu",
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        **_common(data),
    )


_TRANSLATIONS = {"internlm2": _internlm2, "baichuan": _baichuan, "chatglm": _chatglm}
REMOTE_MODEL_TYPES: tuple[str, ...] = tuple(_TRANSLATIONS)


def translate_config(data: dict[str, Any]) -> transformers.PretrainedConfig | None:
    """The transformers config equivalent to a remote-code config.json (`data`), or None when its
    model_type is none of REMOTE_MODEL_TYPES. Raises ValueError for a config missing a field."""
    translate = _TRANSLATIONS.get(data.get("model_type", ""))
    if translate is None:
        return None
    try:
        config = translate(data)
    except KeyError as exc:
        raise ValueError(f"{data['model_type']} config.json has no {exc.args[0]!r}") from exc
    config.architectures = list(data.get("architectures") or [])
    config.remote_code_config = dict(data)
    return config


def _translated(config: Any) -> Any:
    """`config` as translate_config gives it (a plain config of the remote model_type is
    translated here; a translated one is returned as is)."""
    if getattr(config, "model_type", None) in _TRANSLATIONS and not hasattr(
        config, "remote_code_config"
    ):
        data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        translated = translate_config(data)
        assert translated is not None
        return translated
    return config


def _original(config: Any) -> dict[str, Any]:
    return getattr(config, "remote_code_config", None) or {}


def _split_rows(tensor: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.split(sizes, dim=0))


# ---- InternLM2 ------------------------------------------------------------------------------


def _without_dynamic_ntk(config: Any, max_model_len: int | None) -> Any:
    """InternLM2.5's dynamic NTK rope (`rope_scaling` type dynamic) changes the base only for
    sequences longer than `max_position_embeddings`; up to there it is the plain rope. So a
    model served within that length gets a copy of `config` with the plain rope, and a longer
    `max_model_len` is refused (a base that changes with the length does not fit a KV cache
    whose keys were rotated with the old one)."""
    params = rope_parameters_from_config(config)
    if params["rope_type"] != "dynamic":
        return config
    limit = config.max_position_embeddings
    if (max_model_len or limit) > limit:
        raise ValueError(
            f"internlm2 with dynamic NTK rope scaling serves at most max_position_embeddings "
            f"({limit}) tokens, where it is the plain rope; --max-model-len {max_model_len} is "
            "longer"
        )
    plain = copy.deepcopy(config)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    return plain


class InternLM2ForCausalLM(LlamaForCausalLM):
    """InternLM2 / InternLM2.5 on the Llama model (see the module docstring)."""

    _RENAMES = (
        ("model.tok_embeddings.", "model.embed_tokens."),
        (".attention.wo.", ".self_attn.o_proj."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        (".attention_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
    )

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        config = _translated(config)
        super().__init__(
            _without_dynamic_ntk(config, max_model_len), attn_backend, max_model_len, kernels
        )

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        super().check_tensor_parallel(_translated(config), world_size)

    def _split_wqkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """wqkv rows [Hkv, groups + 2, D] (a KV head's q heads, its k, its v) -> q, k, v."""
        cfg = self.config
        kv_heads, d = cfg.num_key_value_heads, self.head_dim
        groups = cfg.num_attention_heads // kv_heads
        rows = tensor.reshape(kv_heads, groups + 2, d, *tensor.shape[1:])
        q = rows[:, :groups].reshape(-1, *tensor.shape[1:])
        k = rows[:, groups].reshape(-1, *tensor.shape[1:])
        v = rows[:, groups + 1].reshape(-1, *tensor.shape[1:])
        return q, k, v

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".attention.wqkv." in name:
                    parts = self._split_wqkv(tensor)
                    for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                        yield name.replace(".attention.wqkv.", f".self_attn.{proj}."), part
                    continue
                if name == "output.weight":
                    name = "lm_head.weight"
                for old, new in self._RENAMES:
                    name = name.replace(old, new)
                yield name, tensor

        return super().load_weights(renamed())


# ---- Baichuan -------------------------------------------------------------------------------


class BaichuanForCausalLM(LlamaForCausalLM):
    """Baichuan-7B / Baichuan2-7B on the Llama model (see the module docstring)."""

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        config = _translated(config)
        self._check_rotary(config)
        super().__init__(config, attn_backend, max_model_len, kernels)
        # Baichuan2 (`BaichuanForCausalLM`) normalises its LM head's rows; Baichuan-7B's
        # (`BaiChuanForCausalLM`) is a plain linear layer.
        self.norm_head = "BaichuanForCausalLM" in (getattr(config, "architectures", None) or [])

    @staticmethod
    def _check_rotary(config: Any) -> None:
        """The 13B models' config.json (ALiBi: hidden_size 5120) has no max_position_embeddings,
        which the rotary models' code reads (Baichuan2-7B: 4096)."""
        original = _original(config)
        if config.hidden_size == 5120 or (original and "max_position_embeddings" not in original):
            raise ValueError(
                "baichuan with ALiBi position biases (the 13B models: hidden_size 5120, no "
                "max_position_embeddings in config.json) is not supported; the 7B models "
                "(rotary) are"
            )

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        config = _translated(config)
        cls._check_rotary(config)
        super().check_tensor_parallel(config, world_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        hidden = self.config.hidden_size

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".self_attn.W_pack." in name:
                    parts = _split_rows(tensor, [hidden] * 3)
                    for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                        yield name.replace(".W_pack.", f".{proj}."), part
                    continue
                if name == "lm_head.weight" and self.norm_head:
                    tensor = nn.functional.normalize(tensor.float(), dim=-1).to(tensor.dtype)
                yield name, tensor

        return super().load_weights(renamed())


# ---- ChatGLM --------------------------------------------------------------------------------


def _check_chatglm(data: dict[str, Any], name_or_path: str = "") -> None:
    refused = {
        "rmsnorm": (False, "LayerNorm layers (rmsnorm false)"),
        "apply_residual_connection_post_layernorm": (True, "the post-layernorm residual"),
        "post_layer_norm": (False, "no final layer norm (post_layer_norm false)"),
        "add_bias_linear": (True, "biases on the linear layers (add_bias_linear)"),
    }
    for key, (bad, what) in refused.items():
        if key in data and bool(data[key]) == bad:
            raise ValueError(f"chatglm with {what} is not supported")
    if data.get("pre_seq_len"):
        raise ValueError("chatglm with a prefix encoder (pre_seq_len, P-tuning) is not supported")
    # ChatGLM3 and GLM-4 multiply the rope base by rope_ratio; ChatGLM2-6B-32k's code divides
    # the positions by it instead, and nothing in config.json tells them apart but the name.
    if float(data.get("rope_ratio") or 1.0) != 1.0 and "chatglm2" in name_or_path.lower():
        raise ValueError(
            "chatglm2 with rope_ratio != 1 (ChatGLM2-6B-32k interpolates positions) is not "
            "supported; Wick reads rope_ratio as ChatGLM3 / GLM-4 do (a base multiplier)"
        )


_CHATGLM_QKV = ".self_attention.query_key_value."


class ChatGLMForCausalLM(GlmForCausalLM):
    """ChatGLM2/3 and remote-code GLM-4 on the GLM model (see the module docstring)."""

    _RENAMES = (
        ("transformer.embedding.word_embeddings.", "model.embed_tokens."),
        ("transformer.encoder.final_layernorm.", "model.norm."),
        ("transformer.output_layer.", "lm_head."),
        ("transformer.encoder.layers.", "model.layers."),
        (".self_attention.dense.", ".self_attn.o_proj."),
        (".mlp.dense_h_to_4h.", ".mlp.gate_up_proj."),
        (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    )

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        config = _translated(config)
        _check_chatglm(_original(config), getattr(config, "_name_or_path", "") or "")
        super().__init__(config, attn_backend, max_model_len, kernels)

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        config = _translated(config)
        _check_chatglm(_original(config), getattr(config, "_name_or_path", "") or "")
        super().check_tensor_parallel(config, world_size)

    def _split_qkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        d = self.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if _original(cfg).get("multi_query_attention", kv_heads != heads):
            return _split_rows(tensor, [heads * d, kv_heads * d, kv_heads * d])
        rows = tensor.reshape(heads, 3, d, *tensor.shape[1:])  # per head: q, k, v
        return tuple(rows[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith("rotary_pos_emb.inv_freq"):
                    continue  # derived state
                for old, new in self._RENAMES:
                    name = name.replace(old, new)
                if _CHATGLM_QKV in name:
                    parts = self._split_qkv(tensor)
                    for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                        yield name.replace(_CHATGLM_QKV, f".self_attn.{proj}."), part
                    continue
                yield name, tensor

        return super().load_weights(renamed())
