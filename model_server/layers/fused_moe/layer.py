"""`FusedMoE`: the routed experts of one MoE layer as two stacked weights, run by the kernel
table's `fused_experts` (grouped PyTorch matmuls on CPU, the Triton kernel on CUDA).

Weights (this rank's): w13_weight [E, 2 * I_local, H] (each expert's gate rows, then its up
rows) and w2_weight [E, H, I_local]. Under tensor parallelism every rank holds every expert, and
a slice of each expert's intermediate dim (I_local = I / tp): rank r has gate/up rows and down
columns [r * I_local, (r + 1) * I_local). Each rank's output is then a partial sum over its
slice, all-reduced here, exactly like a row-parallel down projection.

Checkpoints name the experts one by one (`experts.N.gate_proj` / `up_proj` / `down_proj`,
Mixtral's `experts.N.w1` / `w3` / `w2`) or, as transformers 5 keeps them in memory, stacked
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `weight_loader` takes both.

A GPTQ / AWQ checkpoint (built under `building_quantized_linears`) keeps the experts quantized:
the checkpoint's tensors are registered instead (`w13_qweight`, ..., layers/quantization/
wna16_moe.py), and once loaded `quant_method.process_weights_after_loading` sets `w13_weight`
and `w2_weight` to `WNA16Experts`, which the kernel table's `fused_experts` runs expert by
expert through `wna16_linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from model_server.distributed.partition import divide
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.quantization.base import linear_quant_method
from model_server.layers.quantization.wna16 import WNA16Config
from model_server.layers.quantization.wna16_moe import ExpertShard, WNA16MoEMethod

# Checkpoint shard names -> which part of which stacked weight.
GATE, UP, DOWN = "gate", "up", "down"


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        reduce_results: bool = True,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # whole-model, per expert
        self.local_intermediate = divide(
            intermediate_size, self.tp_size, "moe_intermediate_size (each expert's)"
        )
        self.reduce_results = reduce_results
        # A GPTQ / AWQ checkpoint: its experts' tensors instead of float weights (module doc).
        self.quant_method: WNA16MoEMethod | None = None
        quant = linear_quant_method()
        if quant is None:
            self.make_float_weights()
        elif isinstance(quant, WNA16Config):
            self.quant_method = WNA16MoEMethod(quant)
            self.quant_method.create_weights(self, num_experts, self.expert_shards())
        else:
            raise ValueError(
                f"{quant.method} checkpoints: mixture-of-experts experts cannot be kept in "
                "that format"
            )

    def make_float_weights(self) -> None:
        """The stacked float weights (also where a checkpoint leaves the experts unquantized:
        `modules_to_not_convert`); drops a quantized checkpoint's tensors."""
        for name in list(self._parameters):
            del self._parameters[name]
        self.quant_method = None
        i = self.local_intermediate
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_experts, 2 * i, self.hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_experts, self.hidden_size, i), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def expert_shards(self) -> dict[str, ExpertShard]:
        """Where this rank's slices of an expert's checkpoint matrices go: gate and up split
        along their output (N), down along its input (K), at r * I_local."""
        i_all, i, h = self.intermediate_size, self.local_intermediate, self.hidden_size
        start = self.tp_rank * i
        return {
            "w13": ExpertShard(0, h, h, {GATE: (0, i, start, i_all), UP: (i, i, start, i_all)}),
            "w2": ExpertShard(start, i, i_all, {DOWN: (0, h, 0, h)}),
        }

    def _check(
        self, what: str, loaded: torch.Tensor, expected: tuple[int, ...], name: str | None
    ) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"{name or f'experts {what}'}: checkpoint tensor has shape "
                f"{tuple(loaded.shape)}, expected {expected}"
            )

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
        checkpoint_name: str | None = None,
    ) -> None:
        """One expert's gate / up [I, H] or down [H, I] (`shard_id`, `expert_id`), or with
        `expert_id=None` every expert's at once: gate_up [E, 2I, H] into w13, down [E, H, I] into
        w2 (`shard_id` None). Copies this rank's slice of the intermediate dim. Errors name
        `checkpoint_name` where given."""
        i_all, i, r, h = (
            self.intermediate_size,
            self.local_intermediate,
            self.tp_rank,
            self.hidden_size,
        )
        name = checkpoint_name
        if expert_id is None:
            if param is self.w13_weight:
                self._check("gate_up_proj", loaded_weight, (self.num_experts, 2 * i_all, h), name)
                gate, up = loaded_weight[:, :i_all], loaded_weight[:, i_all:]
                param.data[:, :i].copy_(gate[:, r * i : (r + 1) * i])
                param.data[:, i:].copy_(up[:, r * i : (r + 1) * i])
            else:
                self._check("down_proj", loaded_weight, (self.num_experts, h, i_all), name)
                param.data.copy_(loaded_weight[:, :, r * i : (r + 1) * i])
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the model has {self.num_experts})")
        if shard_id in (GATE, UP):
            self._check(f"{expert_id}.{shard_id}", loaded_weight, (i_all, h), name)
            offset = 0 if shard_id == GATE else i
            param.data[expert_id, offset : offset + i].copy_(loaded_weight[r * i : (r + 1) * i])
        elif shard_id == DOWN:
            self._check(f"{expert_id}.down", loaded_weight, (h, i_all), name)
            param.data[expert_id].copy_(loaded_weight[:, r * i : (r + 1) * i])
        else:
            raise ValueError(f"unknown expert shard {shard_id!r}")

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] float32, topk_ids [T, k] -> [T, H] (summed over ranks
        unless `reduce_results` is False)."""
        out = self.kernels.fused_experts(
            x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.kernels
        )
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}"
            + (f", tp={self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else "")
        )
