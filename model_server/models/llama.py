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
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from model_server.distributed.partition import divide, shard_heads
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
from model_server.layers.rotary import RotaryEmbedding, get_rope

logger = logging.getLogger(__name__)

# (our fused param name part, checkpoint name part, shard id)
STACKED_PARAMS_MAPPING: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
# Checkpoint tensors that are derived state, not weights.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def get_head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


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


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, kernels=kernels
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, kernels=kernels
        )
        self.act_fn = get_act_and_mul_fn(hidden_act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * inter] -> [T, inter] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Under tensor parallelism this rank's heads only (`qkv_proj.shard`): whole KV-head groups,
    so attention is local and o_proj's all-reduce sums the heads' contributions."""

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
        super().__init__()
        self.head_dim = get_head_dim(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        if qkv_bias is None:
            qkv_bias = attention_bias or config.model_type == "qwen2"
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
            bias=attention_bias,
            input_partition=(shard.q_start * self.head_dim, self.q_size),
            kernels=kernels,
        )
        # Qwen3: RMSNorm over each head's vector, applied before rotary.
        self.qk_norm = config.model_type == "qwen3" if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, kernels=kernels)
        # The same instance in every layer: one cos/sin cache for the model.
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            attn_backend,
            sliding_window=sliding_window,
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
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [T, H * D]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, attn_backend, kernels, sliding_window)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            kernels=kernels,
        )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, kernels=kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer's
        input norm adds the two (fused add + norm)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        attn_backend: type[AttentionBackend],
        max_position: int,
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = get_rope(get_head_dim(config), max_position, config, kernels)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, attn_backend, kernels, window)
            for window in layer_sliding_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, kernels=kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, attn_metadata
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The model runner's interface: forward -> hidden states, compute_logits on chosen rows.

    Parameters are uninitialized after construction: call `load_weights` (or the registry's
    `init_dummy_weights`). `max_model_len` sizes the rotary cache (positions must stay below it);
    None means `config.max_position_embeddings`. `kernels`: the matmul, norm and activation
    implementations every layer runs (the platform's `kernel_table()`).
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
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, kernels=kernels)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

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
        """[N, hidden] -> [N, vocab] float32. Pass only the rows that are sampled. Under tensor
        parallelism every rank calls it (the vocabulary is split); only rank 0 gets logits."""
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, fusing q/k/v and gate/up, casting to each param's dtype.

        Returns the names of our parameters that were loaded. Raises ValueError for a tensor
        that matches no parameter, a shape mismatch, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        loaded_shards: dict[str, set[str | int]] = {}
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied to model.embed_tokens.weight
            for fused, part, shard_id in STACKED_PARAMS_MAPPING:
                if part not in name:
                    continue
                target = name.replace(part, fused)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name} matches no parameter")
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                loaded_shards.setdefault(target, set()).add(shard_id)
                break
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name} matches no parameter")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor)
                loaded.add(name)
        for target, shards in loaded_shards.items():
            expected = {s for fused, _, s in STACKED_PARAMS_MAPPING if f"{fused}." in target}
            if shards == expected:
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            partial = {t: sorted(map(str, s)) for t, s in loaded_shards.items() if t in missing}
            detail = f" (fused params with only shards {partial})" if partial else ""
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}{detail}")
        return loaded
