"""The Llama family: Llama 2/3/3.1 (llama3 rope scaling), Mistral, Yi, SmolLM2, Qwen2/2.5, Qwen3,
and Phi-3/3.5 (fused qkv_proj / gate_up_proj checkpoints, LongRoPE).

One implementation, switched on the HF config:
  - head_dim: `config.head_dim` when present (Qwen3 decouples it from hidden/heads), else
    hidden_size // num_attention_heads.
  - attention biases: Llama `attention_bias` (q, k, v and o), Qwen2 always q/k/v (never o),
    Qwen3 `attention_bias`; Llama `mlp_bias` on gate/up/down.
  - Qwen3: per-head RMSNorm on q and k (over head_dim) before rotary.
  - tie_word_embeddings: lm_head shares embed_tokens' weight.
  - sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window, Phi-3): per layer, from
    `layer_types` when the config has them, else on every layer (`layer_sliding_windows`).

Tensor parallelism (model_server.distributed): attention split by KV-head group (groups may be
uneven across ranks, KV heads replicated when there are fewer than ranks), the MLP split evenly,
the vocabulary split for the embedding and the (possibly tied) LM head.

Module names mirror HF's (`model.layers.N.self_attn...`) except the fused `qkv_proj` and
`gate_up_proj`, so `load_weights` maps checkpoint names with a small stacking table.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from model_server.distributed.partition import divide, shard_heads
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.norm import RMSNorm
from model_server.layers.rotary import RotaryEmbedding, get_rope
from model_server.models.decoder_parts import (
    STACKED_PARAMS_MAPPING,
    CheckpointLoading,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    QKVAttention,
    get_head_dim,
    get_num_kv_heads,
    make_lm_head,
)

logger = logging.getLogger(__name__)


__all__ = [
    "STACKED_PARAMS_MAPPING",
    "LlamaAttention",
    "LlamaForCausalLM",
    "LlamaMLP",
    "get_head_dim",
    "get_num_kv_heads",
]


def get_sliding_window(config: Any) -> int | None:
    """The window the checkpoint was trained with, when any layer uses one, else None."""
    windows = [w for w in layer_sliding_windows(config) if w is not None]
    return windows[0] if windows else None


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding window it attends within (HF: keys at positions > p - window),
    or None for full attention. `layer_types` decides when present (Gemma 2/3, Qwen2/3 on
    transformers >= 5); else every layer uses `sliding_window` (Mistral, Phi-3)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n]]
    if getattr(config, "use_sliding_window", None) is False:  # Qwen2 on transformers < 5
        return [None] * n
    return [int(window)] * n


# SwiGLU (hidden_act silu) for Llama; the MoE families' dense and shared experts too.
LlamaMLP = GatedMLP


class LlamaAttention(QKVAttention):
    """QKVAttention with the Llama family's switches read from the config (see the module
    docstring): biases, Qwen3's q/k norm, the layer's window."""

    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
        sliding_window: int | None = None,
        *,
        qkv_bias: bool | None = None,
        qk_norm: bool | None = None,
    ) -> None:
        """`qkv_bias` / `qk_norm` None: what the config's model_type implies (other families
        reusing this attention, e.g. the MoE ones, say it)."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        if qkv_bias is None:
            qkv_bias = attention_bias or config.model_type == "qwen2"
        super().__init__(
            config,
            rotary_emb,
            attn_backend,
            kernels,
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            sliding_window=sliding_window,
            # Qwen3: RMSNorm over each head's vector, applied before rotary.
            qk_norm=config.model_type == "qwen3" if qk_norm is None else qk_norm,
        )


class LlamaDecoderLayer(DecoderLayer):
    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
        sliding_window: int | None = None,
    ) -> None:
        attn = LlamaAttention(config, rotary_emb, attn_backend, kernels, sliding_window)
        mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            kernels=kernels,
        )
        super().__init__(
            attn, mlp, lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps, kernels=kernels)
        )


class LlamaModel(DecoderModel):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_position: int,
        kernels: KernelTable,
    ) -> None:
        super().__init__(config, kernels)
        self.rotary_emb = get_rope(get_head_dim(config), max_position, config, kernels)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, attn_backend, kernels, window)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, kernels=kernels)


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    """The model runner's interface: forward -> hidden states, compute_logits on chosen rows.

    Parameters are uninitialized after construction: call `load_weights` (or the registry's
    `init_dummy_weights`); `load_weights` is CheckpointLoading's. `max_model_len` sizes the
    rotary cache (positions must stay below it); None means `config.max_position_embeddings`.
    `kernels`: the matmul, norm and activation implementations every layer runs (the
    platform's `kernel_table()`).
    """

    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_model_len: int | None = None,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.config = config
        max_position = max_model_len or config.max_position_embeddings
        self.max_position = max_position
        self.sliding_window = get_sliding_window(config)
        self.model = LlamaModel(config, attn_backend, max_position, kernels)
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=False
        )

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Per layer: its attention window or None (the model runner's KV cache groups)."""
        return [layer.self_attn.attn.sliding_window for layer in self.model.layers]

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        """Raise TensorParallelSplitError unless the model splits over `world_size` ranks."""
        for rank in range(world_size):
            shard_heads(config.num_attention_heads, get_num_kv_heads(config), world_size, rank)
        divide(config.intermediate_size, world_size, "intermediate_size")

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return get_head_dim(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: one [2, blocks, block_size, Hkv, D] per
        layer. Returns the final-norm hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] in the model's dtype (the sampler upcasts where it must;
        a greedy step needs no float32 copy). Pass only the rows that are sampled. Under tensor
        parallelism every rank calls it (the vocabulary is split); only rank 0 gets logits."""
        return self.lm_head(hidden_states)
