"""Phi-2 (and Phi-1/1.5: `PhiForCausalLM`): LayerNorm with bias, attention and MLP in parallel
from one norm (out = attn(ln(x)) + mlp(ln(x)) + x), partial rotary (`partial_rotary_factor`,
0.4 for Phi-2), q/k/v and `dense` with biases, a GELU (tanh) MLP fc1 -> fc2, an LM head with bias.

StableLM (models/stablelm.py) reuses the layer with its own MLP and residual order, StarCoder2
(models/starcoder2.py) its sequential form. `qk_layernorm` checkpoints are refused (no released
Phi checkpoint uses it).

The layers describe themselves for a native decoder step (`LayerNormDecoderLayer.stack_layer`);
their LayerNorms (layers/norm.py) and GELU run on the table's kernels, the C ones the CPU's
step runs, so the step gives these modules' bits. The final norm is `norm` (Phi-2's checkpoint
`model.final_layernorm`, renamed on load): the runner adds the step's last residual in it.

Tensor parallelism: heads split like Llama's, fc1 by columns, fc2 by rows, the vocabulary split;
the LM head's bias is whole and added on rank 0 after the gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_server.kernels.stack_layer import StackLayer
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.linear import default_weight_loader
from model_server.layers.norm import LayerNorm
from model_server.layers.rotary import get_rope
from model_server.models.decoder_parts import (
    DecoderModel,
    PlainMLP,
    QKVAttention,
    describe_layer,
    get_head_dim,
    make_lm_head,
)
from model_server.models.llama import LlamaForCausalLM


class ParallelLMHeadWithBias(ParallelLMHead):
    """The LM head plus a whole-vocabulary bias, added where the logits are (rank 0)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, kernels: KernelTable = TORCH_KERNELS
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, kernels=kernels)
        self.bias = nn.Parameter(torch.empty(num_embeddings), requires_grad=False)
        self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().forward(hidden_states)
        return None if logits is None else logits + self.bias


def _check_no_qk_layernorm(config: Any) -> None:
    if getattr(config, "qk_layernorm", False):
        raise ValueError(f"{config.model_type} with qk_layernorm=True is not supported")


class PhiMLP(PlainMLP):
    """fc1 -> GELU (gelu_new: tanh) -> fc2, with biases."""

    def __init__(self, config: Any, kernels: KernelTable) -> None:
        super().__init__(config, kernels, bias=True, names=("fc1", "fc2"), family="phi")


class LayerNormDecoderLayer(nn.Module):
    """input LayerNorm, then either parallel (attn and MLP both from it, summed with the input)
    or sequential (x + attn, then + MLP of `post_attention_layernorm`). The norms run on the
    table's kernels (layers/norm.py's LayerNorm)."""

    def __init__(
        self,
        config: Any,
        self_attn: nn.Module,
        mlp: nn.Module,
        parallel: bool,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.self_attn = self_attn
        self.mlp = mlp
        self.parallel = parallel
        self.input_layernorm = LayerNorm(config.hidden_size, eps=eps, kernels=kernels)
        if not parallel:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=eps, kernels=kernels)

    def stack_layer(self) -> StackLayer | str:
        """This layer described for a native decoder step (models/decoder_parts.py), or why
        not. Its output there is the DecoderLayer convention's (attn + mlp, or the MLP's, with
        the residual stream beside it): the next norm adds the two, in this forward's order."""
        if type(self).forward is not LayerNormDecoderLayer.forward:
            return f"{type(self).__name__} (its own forward)"
        return describe_layer(
            self.self_attn,
            self.mlp,
            input_norm=self.input_layernorm,
            pre_mlp_norm=None if self.parallel else self.post_attention_layernorm,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden_states
        normed = self.input_layernorm(hidden_states)
        attn = self.self_attn(positions, normed, kv_cache, attn_metadata)
        if self.parallel:
            # HF's order of the sums (fp32 results bitwise like it).
            return attn + self.mlp(normed) + residual
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual))


class LayerNormModel(DecoderModel):
    """embed_tokens -> LayerNorm layers -> the final LayerNorm `norm` (Phi-2's checkpoint
    `final_layernorm`: renamed on load; `eps`, `norm_bias`: the config's layer_norm_eps and a
    bias unless given). The model runner may run the layers in one native call instead
    (DecoderModel's `stack_layers()`): it then adds the last residual in
    `norm(hidden, residual)`; this forward runs the layers' own residual convention."""

    def __init__(
        self,
        config: Any,
        layers: list[nn.Module],
        rotary_emb: nn.Module,
        kernels: KernelTable = TORCH_KERNELS,
        *,
        eps: float | None = None,
        norm_bias: bool = True,
    ) -> None:
        super().__init__(config, kernels)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(layers)
        eps = config.layer_norm_eps if eps is None else eps
        self.norm = LayerNorm(config.hidden_size, eps, norm_bias, kernels=kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)


class LayerNormCausalLM(LlamaForCausalLM):
    """The runner interface and loading of Llama over LayerNorm decoder layers (Phi-2,
    StableLM): subclasses say which attention, MLP, residual order and LM head
    (`make_attention`, `make_mlp`, `parallel_residual`, `make_head`)."""

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
        # The rotary rotates the first dims of each head only (partial_rotary_factor).
        rotary = get_rope(get_head_dim(config), self.max_position, config, kernels)
        layers = [
            LayerNormDecoderLayer(
                config,
                self.make_attention(config, rotary, attn_backend, kernels),
                self.make_mlp(config, kernels),
                parallel=self.parallel_residual(config),
                kernels=kernels,
            )
            for _ in range(config.num_hidden_layers)
        ]
        self.model = LayerNormModel(config, layers, rotary, kernels)
        self.tie_word_embeddings, self.lm_head = self.make_head(config, kernels)

    def make_attention(
        self,
        config: Any,
        rotary: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, config: Any, kernels: KernelTable) -> nn.Module:
        raise NotImplementedError

    def parallel_residual(self, config: Any) -> bool:
        raise NotImplementedError

    def make_head(self, config: Any, kernels: KernelTable) -> tuple[bool, ParallelLMHead]:
        return make_lm_head(config, self.model.embed_tokens, kernels, tie_default=False)


class PhiForCausalLM(LayerNormCausalLM):
    """Phi-2 (see the module docstring)."""

    CHECKPOINT_RENAMES = (("model.final_layernorm.", "model.norm."),)

    def make_attention(
        self,
        config: Any,
        rotary: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> nn.Module:
        return QKVAttention(
            config, rotary, attn_backend, kernels, qkv_bias=True, o_bias=True, out_name="dense"
        )

    def make_mlp(self, config: Any, kernels: KernelTable) -> nn.Module:
        return PhiMLP(config, kernels)

    def parallel_residual(self, config: Any) -> bool:
        return True

    def make_head(self, config: Any, kernels: KernelTable) -> tuple[bool, ParallelLMHead]:
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("phi with tie_word_embeddings=True is not supported")
        return False, ParallelLMHeadWithBias(config.vocab_size, config.hidden_size, kernels=kernels)
