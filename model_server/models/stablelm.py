"""StableLM (`StableLmForCausalLM`: StableLM 2, StableLM Zephyr, StableCode): LayerNorm with bias,
partial rotary (`partial_rotary_factor`, 0.25), optional q/k/v bias (`use_qkv_bias`), a SwiGLU
MLP, and either the sequential residual or Phi's parallel one (`use_parallel_residual`).
`qk_layernorm` (StableLM 2 12B's per-head norms) is refused.

Tensor parallelism as Llama's; the layers are Phi's (models/phi.py) with this MLP, the attention
the shared QKVAttention (models/decoder_parts.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.rotary import get_rope
from model_server.models.decoder_parts import QKVAttention, get_head_dim, make_lm_head
from model_server.models.llama import LlamaForCausalLM, LlamaMLP
from model_server.models.phi import LayerNormDecoderLayer, LayerNormModel, _check_no_qk_layernorm


class StableLmForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        nn.Module.__init__(self)
        _check_no_qk_layernorm(config)
        self.config = config
        self.max_position = max_model_len or config.max_position_embeddings
        self.sliding_window = None
        rotary = get_rope(get_head_dim(config), self.max_position, config, kernels)
        layers = [
            LayerNormDecoderLayer(
                config,
                QKVAttention(
                    config,
                    rotary,
                    attn_backend,
                    kernels,
                    qkv_bias=bool(getattr(config, "use_qkv_bias", False)),
                    o_bias=False,
                ),
                LlamaMLP(
                    config.hidden_size,
                    config.intermediate_size,
                    config.hidden_act,
                    bias=False,
                    kernels=kernels,
                ),
                parallel=bool(getattr(config, "use_parallel_residual", False)),
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.model = LayerNormModel(config, layers, rotary, "norm")
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=False
        )
