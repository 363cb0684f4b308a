"""The Gemma family: Gemma, Gemma 2 and Gemma 3 (text), one implementation switched on the config.

What sets them apart from Llama:
  - RMSNorm scales by (1 + weight): `GemmaRMSNorm` keeps the effective scale (1 + checkpoint
    weight) in its parameter, added once at load, so the norm kernels are Llama's.
  - The embedding output is multiplied by sqrt(hidden_size); the LM head is tied to it.
  - GeGLU MLP (`hidden_activation`, gelu tanh approximation).
  - Gemma 2/3: attention scale query_pre_attn_scalar^-0.5; norms after attention and after the
    MLP as well as before ("sandwich"); sliding-window layers interleaved with global ones
    (`layer_types`); Gemma 2 soft-caps attention scores and final logits with c * tanh(x / c).
  - Gemma 3: per-head RMSNorm on q and k before rotary; local (sliding) layers have their own
    rope base (`rope_parameters["sliding_attention"]`), global ones may be scaled.

Tensor parallelism splits like Llama (KV-head groups, MLP, vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.activation import get_act_and_mul_fn
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.attention.layer import Attention
from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_server.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_server.layers.norm import RMSNorm
from model_server.layers.rotary import get_rope, rope_parameters_from_config
from model_server.models.llama import (
    LlamaForCausalLM,
    get_head_dim,
    get_num_kv_heads,
    layer_sliding_windows,
)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w). The parameter holds 1 + w (the checkpoint's w plus one, added by
    its weight loader), so dummy weights of 1 mean an identity scale, as for Llama norms."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, kernels: KernelTable = TORCH_KERNELS
    ) -> None:
        super().__init__(hidden_size, eps, kernels=kernels)
        self.weight.weight_loader = _load_plus_one  # type: ignore[attr-defined]


def _load_plus_one(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    default_weight_loader(param, loaded_weight.float() + 1.0)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, kernels: KernelTable, bias: bool = False) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, kernels=kernels
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=bias, kernels=kernels
        )
        self.act_fn = get_act_and_mul_fn(act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    """q/k/v fused, this rank's heads only; optional per-head q/k norm (Gemma 3), soft cap and
    sliding window, and the scale the config asks for."""

    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
        *,
        scale: float,
        sliding_window: int | None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            get_num_kv_heads(config),
            bias=qkv_bias,
            kernels=kernels,
        )
        shard = self.qkv_proj.shard
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            input_partition=(shard.q_start * self.head_dim, self.q_size),
            kernels=kernels,
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            scale,
            self.num_kv_heads,
            attn_backend,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class SandwichDecoderLayer(nn.Module):
    """Pre-norm decoder layer with optional norms after attention and after the MLP (Gemma 2/3,
    GLM-4). Returns (MLP output, residual before it): the next layer's input norm adds them."""

    def __init__(
        self,
        self_attn: GemmaAttention,
        mlp: nn.Module,
        make_norm: Any,
        post_norms: bool,
        names: tuple[str, str, str, str] = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_norms = post_norms
        # Checkpoint names of: the input norm, the norm on the attention output, the norm
        # before the MLP, the norm on the MLP output. Without post norms (Gemma 1) HF calls the
        # norm before the MLP `post_attention_layernorm`.
        if post_norms:
            self._norm_names = names
        else:
            self._norm_names = (names[0], "", "post_attention_layernorm", "")
        for name in self._norm_names:
            if name:
                setattr(self, name, make_norm())

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_norm, post_attn, pre_mlp, post_mlp = (
            getattr(self, n) if n else None for n in self._norm_names
        )
        if residual is None:
            residual = hidden_states
            hidden_states = input_norm(hidden_states)
        else:
            hidden_states, residual = input_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        if post_attn is not None:
            hidden_states = post_attn(hidden_states)
        hidden_states, residual = pre_mlp(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if post_mlp is not None:
            hidden_states = post_mlp(hidden_states)
        return hidden_states, residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_position: int,
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        model_type = config.model_type
        gemma2_or_3 = model_type != "gemma"
        head_dim = get_head_dim(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        rope_params = getattr(config, "rope_parameters", None) or {}
        if "sliding_attention" in rope_params:
            # Gemma 3: one rotary per layer type (local base for sliding layers).
            ropes = {
                t: get_rope(head_dim, max_position, config, kernels, params=_flat(p))
                for t, p in rope_params.items()
            }
            self.rotary_emb = ropes["full_attention"]
            self.rotary_emb_local = ropes["sliding_attention"]
        else:
            self.rotary_emb = get_rope(head_dim, max_position, config, kernels)
            self.rotary_emb_local = self.rotary_emb
        scalar = getattr(config, "query_pre_attn_scalar", None)
        scale = (scalar if gemma2_or_3 and scalar else head_dim) ** -0.5
        soft_cap_attn = getattr(config, "attn_logit_softcapping", None)
        eps = config.rms_norm_eps

        def make_norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(config.hidden_size, eps=eps, kernels=kernels)

        self.layers = nn.ModuleList()
        for window in layer_sliding_windows(config):
            attn = GemmaAttention(
                config,
                self.rotary_emb_local if window is not None else self.rotary_emb,
                attn_backend,
                kernels,
                scale=scale,
                sliding_window=window,
                qkv_bias=bool(getattr(config, "attention_bias", False)),
                o_bias=bool(getattr(config, "attention_bias", False)),
                qk_norm=model_type in ("gemma3", "gemma3_text"),
                logits_soft_cap=soft_cap_attn,
            )
            self.layers.append(
                SandwichDecoderLayer(attn, GemmaMLP(config, kernels), make_norm, gemma2_or_3)
            )
        self.norm = make_norm()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by the scale cast to the activations' dtype.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def _flat(params: dict[str, Any]) -> dict[str, Any]:
    """One layer type's rope parameters in `rope_parameters_from_config`'s flat form."""
    from types import SimpleNamespace

    return rope_parameters_from_config(SimpleNamespace(rope_parameters=dict(params)))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma, Gemma 2, Gemma 3 text (see the module docstring); the model runner's interface
    and weight loading are Llama's."""

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        max_position = max_model_len or config.max_position_embeddings
        self.max_position = max_position
        windows = [w for w in layer_sliding_windows(config) if w is not None]
        self.sliding_window = windows[0] if windows else None
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.model = GemmaModel(config, attn_backend, max_position, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, kernels=kernels)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None:
            return None
        return soft_cap(logits.float(), self.final_logit_softcapping)
