"""The decoder skeleton shared by the mixture-of-experts families (models/mixtral.py,
qwen_moe.py, deepseek.py): embedding, pre-norm decoder layers (attention, then a dense MLP or
an MoE block), final norm, LM head, and HF checkpoint loading with the experts' names.

A family subclasses `MoECausalLM` and provides `make_layer_parts` (its attention and MLP per
layer), `make_rotary`, and `check_tensor_parallel`. Module names mirror HF's
(`model.layers.N.self_attn...`, `model.layers.N.mlp...`) except the fused `qkv_proj`,
`gate_up_proj` and the stacked experts (`mlp.experts.w13_weight`, `mlp.experts.w2_weight`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_server.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from model_server.layers.linear import default_weight_loader
from model_server.layers.norm import RMSNorm
from model_server.models.llama import STACKED_PARAMS_MAPPING

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# `...experts.<id>.<proj>.weight` of per-expert checkpoints (Qwen, DeepSeek; Mixtral's w1/w3/w2).
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_EXPERT_SHARDS = {
    "gate_proj": GATE, "up_proj": UP, "down_proj": DOWN, "w1": GATE, "w3": UP, "w2": DOWN
}  # fmt: skip


class MoEDecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)), with the residual add fused into the norms
    (the next layer's input norm adds this layer's MLP output)."""

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, config: Any, kernels: KernelTable
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MoEModel(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        make_layer: Callable[[int], MoEDecoderLayer],
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
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


class MoECausalLM(nn.Module):
    """The model runner's interface (see models/llama.py's LlamaForCausalLM) for MoE families.

    Subclasses implement `make_rotary(config, max_position, kernels)`,
    `make_layer_parts(config, layer_idx, rotary_emb, attn_backend, kernels) -> (attn, mlp)` and
    the classmethod `check_tensor_parallel(config, world_size)`; they may set
    `CHECKPOINT_RENAMES` (substring renames applied to checkpoint names first) and override
    `transform_weight(name, tensor)` / `skip_weight(name)`.
    """

    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()
    # (our fused param name part, checkpoint name part, shard id), as models/llama.py's.
    STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = STACKED_PARAMS_MAPPING

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
        rotary_emb = self.make_rotary(config, max_position, kernels)

        def make_layer(i: int) -> MoEDecoderLayer:
            attn, mlp = self.make_layer_parts(config, i, rotary_emb, attn_backend, kernels)
            return MoEDecoderLayer(attn, mlp, config, kernels)

        self.model = MoEModel(config, rotary_emb, make_layer, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, kernels=kernels)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    # ---- what subclasses provide ------------------------------------------------------------

    def make_rotary(self, config: Any, max_position: int, kernels: KernelTable) -> nn.Module:
        raise NotImplementedError

    def make_layer_parts(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> tuple[nn.Module, nn.Module]:
        raise NotImplementedError

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        raise NotImplementedError

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def skip_weight(self, name: str) -> bool:
        return False

    # ---- the runner's interface -------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (all of them without tensor parallelism)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: one tensor per layer (the runner's
        layout, or the model's own `kv_cache_shape` where it defines one). Returns the
        final-norm hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] float32 on rank 0 (None elsewhere under TP)."""
        logits = self.lm_head(hidden_states)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors: q/k/v and gate/up fused, the experts stacked (per-expert or
        transformers 5's stacked names). Returns the names of our parameters that were loaded.
        Raises ValueError for a tensor that matches no parameter, a shape mismatch, or
        parameters left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        loaded_shards: dict[str, set[Any]] = {}
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES) or self.skip_weight(name):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            for old, new in self.CHECKPOINT_RENAMES:
                name = name.replace(old, new)
            tensor = self.transform_weight(name, tensor)
            if (match := _EXPERT_RE.match(name)) and match.group(3) in _EXPERT_SHARDS:
                prefix, expert, shard = match.group(1), int(match.group(2)), match.group(3)
                shard_id = _EXPERT_SHARDS[shard]
                target = f"{prefix}.{'w2_weight' if shard_id == DOWN else 'w13_weight'}"
                param = self._param(params, target, name)
                param.weight_loader(param, tensor, shard_id, expert)  # type: ignore[attr-defined]
                loaded_shards.setdefault(target, set()).add((expert, shard_id))
                continue
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                prefix, part = name.rsplit(".", 1)
                target = f"{prefix}.{'w13_weight' if part == 'gate_up_proj' else 'w2_weight'}"
                param = self._param(params, target, name)
                param.weight_loader(param, tensor)  # type: ignore[attr-defined]
                loaded.add(target)
                continue
            for fused, part, shard_id in self.STACKED_PARAMS:
                if part not in name:
                    continue
                target = name.replace(part, fused)
                param = self._param(params, target, name)
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
                loaded_shards.setdefault(target, set()).add(shard_id)
                break
            else:
                param = self._param(params, name, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        modules = dict(self.named_modules())
        for target, shards in loaded_shards.items():
            if shards == self._expected_shards(target, modules):
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}")
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} matches no parameter")
        return param

    def _expected_shards(self, target: str, modules: dict[str, nn.Module]) -> set[Any]:
        owner = modules.get(target.rsplit(".", 1)[0])
        if isinstance(owner, FusedMoE):
            parts = (DOWN,) if target.endswith("w2_weight") else (GATE, UP)
            return {(e, p) for e in range(owner.num_experts) for p in parts}
        return {s for fused, _, s in self.STACKED_PARAMS if f"{fused}." in target}
