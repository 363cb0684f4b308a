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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.fused_moe import DOWN, GATE, UP, FusedMoE
from model_server.layers.norm import RMSNorm
from model_server.models.decoder_parts import (
    CheckpointLoading,
    DecoderLayer,
    DecoderModel,
    make_lm_head,
    param_for,
)

# `...experts.<id>.<proj>.weight` of per-expert checkpoints (Qwen, DeepSeek; Mixtral's w1/w3/w2),
# or a GPTQ / AWQ checkpoint's `.qweight`, `.qzeros`, `.scales`, `.g_idx` of that projection.
_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|qweight|qzeros|scales|g_idx)$")
# `...experts.<proj>.weight` holding every expert, [num_experts, ...] (GGUF files' `ffn_*_exps`).
_STACKED_EXPERT_RE = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARDS = {
    "gate_proj": GATE, "up_proj": UP, "down_proj": DOWN, "w1": GATE, "w3": UP, "w2": DOWN
}  # fmt: skip


class MoEDecoderLayer(DecoderLayer):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)) (a dense MLP or an MoE block), RMSNorms with
    the residual add fused in (the next layer's input norm adds this layer's MLP output)."""

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, config: Any, kernels: KernelTable
    ) -> None:
        eps = config.rms_norm_eps
        super().__init__(
            self_attn, mlp, lambda: RMSNorm(config.hidden_size, eps=eps, kernels=kernels)
        )


class MoEModel(DecoderModel):
    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        make_layer: Callable[[int], MoEDecoderLayer],
        kernels: KernelTable,
    ) -> None:
        super().__init__(config)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, kernels=kernels)


class MoECausalLM(CheckpointLoading, nn.Module):
    """The model runner's interface (see models/llama.py's LlamaForCausalLM) for MoE families.

    Subclasses implement `make_rotary(config, max_position, kernels)`,
    `make_layer_parts(config, layer_idx, rotary_emb, attn_backend, kernels) -> (attn, mlp)` and
    the classmethod `check_tensor_parallel(config, world_size)`; they may set
    `CHECKPOINT_RENAMES` (substring renames applied to checkpoint names first) and override
    `transform_weight(name, tensor)` / `skip_weight(name)`.
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
        rotary_emb = self.make_rotary(config, max_position, kernels)

        def make_layer(i: int) -> MoEDecoderLayer:
            attn, mlp = self.make_layer_parts(config, i, rotary_emb, attn_backend, kernels)
            return MoEDecoderLayer(attn, mlp, config, kernels)

        self.model = MoEModel(config, rotary_emb, make_layer, kernels)
        self.tie_word_embeddings, self.lm_head = make_lm_head(
            config, self.model.embed_tokens, kernels, tie_default=False
        )

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
        """[N, hidden] -> [N, vocab] in the model's dtype on rank 0 (None elsewhere under TP)."""
        return self.lm_head(hidden_states)

    def load_special_weight(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        tensor: torch.Tensor,
        loaded: set[str],
        loaded_shards: dict[str, set[Any]],
        checkpoint_name: str | None = None,
    ) -> bool:
        """The experts, into the stacked w13 / w2 params: one expert's projection at a time
        (float, or a GPTQ / AWQ checkpoint's tensors of it), transformers 5's stacked gate_up /
        down, or one tensor per projection holding every expert (GGUF's `ffn_*_exps`)."""
        if (match := _STACKED_EXPERT_RE.match(name)) and tensor.dim() == 3:
            prefix, shard = match.groups()
            shard_id = _EXPERT_SHARDS[shard]
            target = f"{prefix}.{'w2_weight' if shard_id == DOWN else 'w13_weight'}"
            param = param_for(params, target, name)
            for expert in range(tensor.shape[0]):
                param.weight_loader(param, tensor[expert], shard_id, expert)  # type: ignore[attr-defined]
                loaded_shards.setdefault(target, set()).add((expert, shard_id))
            return True
        if (match := _EXPERT_RE.match(name)) and match.group(3) in _EXPERT_SHARDS:
            prefix, expert, shard, kind = match.groups()
            shard_id = _EXPERT_SHARDS[shard]
            # w13_weight / w2_weight, or a quantized checkpoint's w13_qweight, w2_scales, ...
            target = f"{prefix}.{'w2' if shard_id == DOWN else 'w13'}_{kind}"
            param = param_for(params, target, checkpoint_name or name)
            param.weight_loader(  # type: ignore[attr-defined]
                param, tensor, shard_id, int(expert), checkpoint_name=checkpoint_name or name
            )
            loaded_shards.setdefault(target, set()).add((int(expert), shard_id))
            return True
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            prefix, part = name.rsplit(".", 1)
            target = f"{prefix}.{'w13_weight' if part == 'gate_up_proj' else 'w2_weight'}"
            param = param_for(params, target, name)
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
            loaded.add(target)
            return True
        return False

    @property
    def supports_graphs(self) -> bool:
        """Whether decode steps may be captured as device graphs: not with experts kept
        quantized, whose grouped path reads each expert's token count on the host."""
        return not any(
            isinstance(m, FusedMoE) and m.quant_method is not None for m in self.modules()
        )

    def expected_shards(self, target: str, modules: dict[str, nn.Module]) -> set[Any]:
        owner = modules.get(target.rsplit(".", 1)[0])
        if isinstance(owner, FusedMoE):
            parts = (DOWN,) if target.rsplit(".", 1)[1].startswith("w2_") else (GATE, UP)
            return {(e, p) for e in range(owner.num_experts) for p in parts}
        return super().expected_shards(target, modules)
