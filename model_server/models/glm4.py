"""GLM-4 (`Glm4ForCausalLM`, GLM-4-9B-0414 and GLM-4-32B): Llama-like attention with q/k/v bias
(`attention_bias`), fused `gate_up_proj` SwiGLU in the checkpoint, norms before and after both
attention and MLP (Gemma 2's sandwich, plain RMSNorm), and partial rotary (half of each head) in
the interleaved (GPT-J) layout: dims (2i, 2i + 1) rotate together.

GLM-4 in its original `-hf` layout (`GlmForCausalLM`, glm-4-9b-chat-hf) is the same model without
the sandwich norms (Llama's two norms per layer): `GlmForCausalLM` below. The remote-code
ChatGLM checkpoints (`ChatGLMModel`) load into it too (models/remote_code.py).

The interleaved rotary becomes the neox rotary the kernels implement by permuting the rotary
dims of each q and k head at load time (even dims first, then odd ones): q . k is unchanged
when both get the same permutation, and v and the output are not touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.norm import RMSNorm
from model_server.layers.quantization.gguf import GGUFTensor
from model_server.layers.rotary import get_rope, rope_parameters_from_config
from model_server.models.decoder_parts import (
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    QKVAttention,
    get_head_dim,
    make_lm_head,
)
from model_server.models.llama import LlamaForCausalLM

_NORM_NAMES = (
    "input_layernorm",
    "post_self_attn_layernorm",
    "post_attention_layernorm",
    "post_mlp_layernorm",
)


def interleaved_to_neox(
    rows: torch.Tensor | GGUFTensor, head_dim: int, rotary_dim: int
) -> torch.Tensor:
    """Permute the output rows ([heads * head_dim, ...]) of a q or k projection so that each
    head's rotary dims (0, 2, 4, ... then 1, 3, 5, ...) pair as neox halves. A row gather, so a
    GGUF matrix kept quantized (whole rows of blocks) takes it too."""
    perm = torch.cat(
        (
            torch.arange(0, rotary_dim, 2),
            torch.arange(1, rotary_dim, 2),
            torch.arange(rotary_dim, head_dim),
        )
    )
    heads = rows.shape[0] // head_dim
    index = (torch.arange(heads)[:, None] * head_dim + perm).reshape(-1)
    if isinstance(rows, GGUFTensor):  # --gguf-weights quantized
        return rows.permute_rows(index)  # type: ignore[return-value]
    return rows[index]


class Glm4Model(DecoderModel):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_position: int,
        kernels: KernelTable,
        sandwich: bool = True,
    ) -> None:
        super().__init__(config)
        head_dim = get_head_dim(config)
        self.rotary_emb = get_rope(head_dim, max_position, config, kernels)
        eps = config.rms_norm_eps

        def make_norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps=eps, kernels=kernels)

        bias = bool(getattr(config, "attention_bias", False))
        self.layers = nn.ModuleList(
            DecoderLayer(
                QKVAttention(
                    config, self.rotary_emb, attn_backend, kernels, qkv_bias=bias, o_bias=False
                ),
                GatedMLP(
                    config.hidden_size, config.intermediate_size, config.hidden_act, False, kernels
                ),
                make_norm,
                post_norms=sandwich,
                names=_NORM_NAMES,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = make_norm()


class Glm4ForCausalLM(LlamaForCausalLM):
    # Norms after attention and after the MLP as well as before (GLM-4-0414); GlmForCausalLM
    # has Llama's two.
    SANDWICH_NORMS = True

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
        self.sliding_window = None
        self.model = Glm4Model(
            config, attn_backend, self.max_position, kernels, sandwich=self.SANDWICH_NORMS
        )
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=False
        )
        head_dim = get_head_dim(config)
        factor = float(rope_parameters_from_config(config).get("partial_rotary_factor") or 1.0)
        self._rotary = (head_dim, int(head_dim * factor))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names; q/k projections (weights and biases) get the rotary permutation."""
        head_dim, rotary_dim = self._rotary

        def permuted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                    tensor = interleaved_to_neox(tensor, head_dim, rotary_dim)
                yield name, tensor

        return super().load_weights(permuted())


class GlmForCausalLM(Glm4ForCausalLM):
    """GLM-4 in the `-hf` layout (`GlmForCausalLM`): GLM-4's attention, rotary and fused
    gate_up MLP with Llama's pre-norms only (`input_layernorm`, `post_attention_layernorm`)."""

    SANDWICH_NORMS = False
