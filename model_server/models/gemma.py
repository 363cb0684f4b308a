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
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.linear import default_weight_loader
from model_server.layers.norm import RMSNorm
from model_server.layers.rotary import get_rope, rope_parameters_from_config
from model_server.models.decoder_parts import (
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    QKVAttention,
    get_head_dim,
    make_lm_head,
)
from model_server.models.llama import LlamaForCausalLM, layer_sliding_windows


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


class GemmaMLP(GatedMLP):
    """GeGLU (`hidden_activation`, else `hidden_act`) over the config's sizes."""

    def __init__(self, config: Any, kernels: KernelTable, bias: bool = False) -> None:
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        super().__init__(config.hidden_size, config.intermediate_size, act, bias, kernels)


class GemmaAttention(QKVAttention):
    """QKVAttention with Gemma's (1 + w) norms for Gemma 3's per-head q/k norm; the scale, soft
    cap and window as the config asks."""

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
        super().__init__(
            config,
            rotary_emb,
            attn_backend,
            kernels,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            qk_norm=qk_norm,
            norm_cls=GemmaRMSNorm,
        )


class GemmaModel(DecoderModel):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_position: int,
        kernels: KernelTable,
    ) -> None:
        super().__init__(config)
        model_type = config.model_type
        gemma2_or_3 = model_type != "gemma"
        head_dim = get_head_dim(config)
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
                DecoderLayer(attn, GemmaMLP(config, kernels), make_norm, gemma2_or_3)
            )
        self.norm = make_norm()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by the scale cast to the activations' dtype.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


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
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=True
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden_states)
        if logits is None:
            return None
        return soft_cap(logits.float(), self.final_logit_softcapping)
