"""StableLM (`StableLmForCausalLM`: StableLM 2, StableLM Zephyr, StableCode): LayerNorm with bias,
partial rotary (`partial_rotary_factor`, 0.25), optional q/k/v bias (`use_qkv_bias`), a SwiGLU
MLP, and either the sequential residual or Phi's parallel one (`use_parallel_residual`).
`qk_layernorm` (StableLM 2 12B's per-head norms) is refused.

Tensor parallelism as Llama's; the model is Phi's LayerNormCausalLM (models/phi.py) with this
attention (no output bias), MLP and residual order.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from model_server.kernels.table import KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.models.decoder_parts import QKVAttention
from model_server.models.llama import LlamaMLP
from model_server.models.phi import LayerNormCausalLM


class StableLmForCausalLM(LayerNormCausalLM):
    def make_attention(
        self,
        config: Any,
        rotary: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> nn.Module:
        qkv_bias = bool(getattr(config, "use_qkv_bias", False))
        return QKVAttention(config, rotary, attn_backend, kernels, qkv_bias=qkv_bias, o_bias=False)

    def make_mlp(self, config: Any, kernels: KernelTable) -> nn.Module:
        return LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, False, kernels
        )

    def parallel_residual(self, config: Any) -> bool:
        return bool(getattr(config, "use_parallel_residual", False))
