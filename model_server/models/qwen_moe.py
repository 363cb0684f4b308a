"""Qwen2-MoE and Qwen3-MoE (`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`).

Attention: Qwen2's (q/k/v bias when `qkv_bias`) or Qwen3's (per-head q/k RMSNorm,
`attention_bias`). MLP: a sparse MoE block in layer i unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step` (then a dense MLP of `intermediate_size`).
The router is a softmax top-k over `num_experts`, renormalised when `norm_topk_prob`. Qwen2-MoE
adds a shared expert (a dense MLP of `shared_expert_intermediate_size`) to every MoE block,
scaled by sigmoid(`shared_expert_gate`(x)). Sliding-window attention is not implemented (the
released configs leave it off).

Tensor parallelism: attention by KV-head group, the experts' intermediate dim and the shared
expert split evenly, the routers and the shared-expert gate replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from model_server.distributed.partition import divide
from model_server.kernels.stack_layer import StackMoE
from model_server.kernels.table import KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.linear import ReplicatedLinear
from model_server.layers.quantization.base import building_quantized_linears
from model_server.layers.rotary import get_rope
from model_server.models.llama import LlamaAttention, LlamaMLP, get_head_dim
from model_server.models.mixtral import SparseMoEBlock, check_attention_split
from model_server.models.moe_decoder import MoECausalLM


class QwenMoEBlock(SparseMoEBlock):
    """Routed experts, plus Qwen2-MoE's gated shared expert when the config has one."""

    def __init__(self, config: Any, kernels: KernelTable) -> None:
        super().__init__(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            kernels=kernels,
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.has_shared_expert = shared > 0
        if self.has_shared_expert:
            self.shared_expert = LlamaMLP(
                config.hidden_size, shared, config.hidden_act, bias=False, kernels=kernels
            )
            with building_quantized_linears(None):  # float, like the router
                self.shared_expert_gate = ReplicatedLinear(
                    config.hidden_size, 1, bias=False, kernels=kernels
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.has_shared_expert:
            gate = self.shared_expert_gate(x)  # [T, 1]
            out = self.kernels.shared_expert_add(out, gate, self.shared_expert(x))
        return out

    def stack_moe(self) -> tuple[StackMoE, nn.Module | None] | str:
        described = super().stack_moe()
        if isinstance(described, str) or not self.has_shared_expert:
            return described
        moe = dataclasses.replace(described[0], shared_gate=self.shared_expert_gate)
        return moe, self.shared_expert


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


class QwenMoeForCausalLM(MoECausalLM):
    def make_rotary(self, config: Any, max_position: int, kernels: KernelTable) -> nn.Module:
        return get_rope(get_head_dim(config), max_position, config, kernels)

    def make_layer_parts(
        self,
        config: Any,
        layer_idx: int,
        rotary_emb: nn.Module,
        attn_backend: type[AttentionBackend],
        kernels: KernelTable,
    ) -> tuple[nn.Module, nn.Module]:
        qwen3 = config.model_type == "qwen3_moe"
        qkv_bias = (
            bool(getattr(config, "attention_bias", False))
            if qwen3
            else bool(getattr(config, "qkv_bias", True))
        )
        attn = LlamaAttention(
            config, rotary_emb, attn_backend, kernels, qkv_bias=qkv_bias, qk_norm=qwen3
        )
        if is_moe_layer(config, layer_idx):
            return attn, QwenMoEBlock(config, kernels)
        dense = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, False, kernels
        )
        return attn, dense

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        check_attention_split(config, world_size)
        divide(config.moe_intermediate_size, world_size, "moe_intermediate_size")
        if getattr(config, "shared_expert_intermediate_size", 0):
            divide(
                config.shared_expert_intermediate_size,
                world_size,
                "shared_expert_intermediate_size",
            )
        if any(not is_moe_layer(config, i) for i in range(config.num_hidden_layers)):
            divide(config.intermediate_size, world_size, "intermediate_size")
