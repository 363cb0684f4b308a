"""StarCoder2 (`Starcoder2ForCausalLM`): LayerNorm with bias (`norm_epsilon`), q/k/v/o biases and a
non-gated GELU MLP `c_fc` -> `c_proj` with biases (`use_bias`), GQA, full-head neox rotary, a
sliding window on every layer (`sliding_window`), the LM head tied to the embedding unless the
config says otherwise.

Built from Phi's LayerNorm decoder layer and model (models/phi.py) with explicit eps and bias,
which DBRX (models/dbrx.py) reuses without the bias. Tensor parallelism as Llama's: heads by
KV-head group, c_fc by columns, c_proj by rows, the vocabulary split.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.norm import LayerNorm
from model_server.layers.rotary import get_rope
from model_server.models.decoder_parts import (
    PlainMLP,
    QKVAttention,
    get_head_dim,
    make_lm_head,
)
from model_server.models.llama import LlamaForCausalLM, get_sliding_window, layer_sliding_windows
from model_server.models.phi import LayerNormDecoderLayer, LayerNormModel


class SequentialLayerNormLayer(LayerNormDecoderLayer):
    """x + attn(ln1(x)), then + mlp(ln2(.)): Phi's layer in its sequential form, with the eps and
    LayerNorm bias given rather than read from `layer_norm_eps`."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        norm_bias: bool,
        self_attn: nn.Module,
        mlp: nn.Module,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        nn.Module.__init__(self)
        self.self_attn = self_attn
        self.mlp = mlp
        self.parallel = False
        self.input_layernorm = LayerNorm(hidden_size, eps, norm_bias, kernels=kernels)
        self.post_attention_layernorm = LayerNorm(hidden_size, eps, norm_bias, kernels=kernels)


class Starcoder2MLP(PlainMLP):
    """c_fc -> GELU -> c_proj (biases per `use_bias`)."""

    def __init__(self, config: Any, bias: bool, kernels: KernelTable) -> None:
        super().__init__(config, kernels, bias=bias, names=("c_fc", "c_proj"), family="starcoder2")


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder2 (see the module docstring); the runner interface, tensor-parallel check and
    loading are Llama's (HF's module names)."""

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.max_position = max_model_len or config.max_position_embeddings
        self.sliding_window = get_sliding_window(config)
        bias = bool(getattr(config, "use_bias", True))
        eps = config.norm_epsilon
        rotary = get_rope(get_head_dim(config), self.max_position, config, kernels)
        layers = [
            SequentialLayerNormLayer(
                config.hidden_size,
                eps,
                True,
                QKVAttention(
                    config,
                    rotary,
                    attn_backend,
                    kernels,
                    qkv_bias=bias,
                    o_bias=bias,
                    sliding_window=window,
                ),
                Starcoder2MLP(config, bias, kernels),
                kernels,
            )
            for window in layer_sliding_windows(config)
        ]
        self.model = LayerNormModel(config, layers, rotary, kernels, eps=eps, norm_bias=True)
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=True
        )
