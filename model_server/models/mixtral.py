"""Mixtral (`MixtralForCausalLM`): Mistral attention, every MLP a sparse MoE block of
`num_local_experts` experts, `num_experts_per_tok` chosen per token by a softmax router and
renormalised. Checkpoints name the block `block_sparse_moe` and the experts' gate/down/up
`w1`/`w2`/`w3` (transformers 5 renames them to `mlp`, as we do). Sliding-window attention
(Mixtral v0.1 configs set none) is not implemented, as for Mistral (models/llama.py).

Tensor parallelism: attention by KV-head group (models/llama.py), every expert's intermediate
dim split evenly (layers/fused_moe/layer.py), the router replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_server.distributed.partition import divide, shard_heads
from model_server.kernels.stack_layer import StackMoE
from model_server.kernels.table import KernelTable
from model_server.layers.attention.backend import AttentionBackend
from model_server.layers.fused_moe import FusedMoE
from model_server.layers.linear import ReplicatedLinear
from model_server.layers.quantization.base import building_quantized_linears
from model_server.layers.rotary import get_rope
from model_server.models.llama import LlamaAttention, get_head_dim, get_num_kv_heads
from model_server.models.moe_decoder import MoECausalLM


class SparseMoEBlock(nn.Module):
    """Router (`gate`, [E, hidden]) + routed experts: [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        kernels: KernelTable,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.kernels = kernels
        # The router stays float in GPTQ / AWQ checkpoints (the tools never quantize it).
        with building_quantized_linears(None):
            self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, kernels=kernels)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, kernels=kernels)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.moe_softmax_topk(self.gate(x), self.top_k, self.renormalize)

    def stack_moe(self) -> tuple[StackMoE, nn.Module | None] | str:
        """This block for a native decoder step (models/decoder_parts.py's `describe_layer`):
        (its description, the shared expert's MLP or None), or what it has instead. Experts
        kept quantized (GPTQ / AWQ) are described as they are: the platform says whether it runs
        them."""
        moe = StackMoE(
            router=self.gate,
            w13=self.experts.w13_weight,
            w2=self.experts.w2_weight,
            top_k=self.top_k,
            renormalize=self.renormalize,
            tp_size=self.experts.tp_size,
        )
        return moe, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        return self.experts(x, weights, ids)


def check_attention_split(config: Any, world_size: int) -> None:
    for rank in range(world_size):
        shard_heads(config.num_attention_heads, get_num_kv_heads(config), world_size, rank)


class MixtralForCausalLM(MoECausalLM):
    CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)

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
        attn = LlamaAttention(
            config, rotary_emb, attn_backend, kernels, qkv_bias=False, qk_norm=False
        )
        mlp = SparseMoEBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            kernels=kernels,
        )
        return attn, mlp

    @classmethod
    def check_tensor_parallel(cls, config: Any, world_size: int) -> None:
        check_attention_split(config, world_size)
        divide(config.intermediate_size, world_size, "intermediate_size (each expert's)")
