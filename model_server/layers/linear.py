"""Linear layers with vLLM's names and weight-loading hooks.

Wick runs on one rank today, so every layer holds the whole matrix; the vLLM names (and the
`weight_loader(param, loaded_weight[, shard_id])` hook attached to each parameter) mark where
tensor parallelism would shard. Fused layers (`QKVParallelLinear`, `MergedColumnParallelLinear`)
hold several HF matrices stacked along the output dim so one matmul replaces two or three.

Parameters are allocated with `torch.empty` (no init pass: checkpoints or
`init_dummy_weights` fill them), on the default device and dtype, and never require grad.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_linear_impl: LinearFn = F.linear


def set_linear_impl(fn: LinearFn | None) -> None:
    """Install the platform's dense matmul (None restores `F.linear`); see platforms/."""
    global _linear_impl
    _linear_impl = fn or F.linear


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T + bias: every linear layer and the LM head call this."""
    return _linear_impl(x, weight, bias)


def _check_shape(name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"expected {tuple(param.shape)}"
        )


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into `param`, casting to its dtype and device."""
    _check_shape("weight", param, loaded_weight)
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(output_size), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A plain linear layer (whole matrix on every rank)."""


class RowParallelLinear(LinearBase):
    """Splits the input dim under tensor parallelism (o_proj, down_proj); whole on one rank."""


class ColumnParallelLinear(LinearBase):
    """Splits the output dim under tensor parallelism; whole on one rank."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices with the same input stacked along the output dim.

    Used for gate_up_proj: shard 0 is gate_proj, shard 1 is up_proj, so the output is
    [T, sum(output_sizes)] with each shard's columns contiguous in that order.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused matrix
            default_weight_loader(param, loaded_weight)
            return
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        target = param.data.narrow(0, offset, size)
        _check_shape(f"shard {shard_id}", target, loaded_weight)
        target.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: output [T, (H + 2 * Hkv) * D] laid out as q | k | v."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads
        self.q_size = total_num_heads * head_size
        self.kv_size = total_num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        """(offset, size) of shard "q", "k" or "v" along the output dim."""
        if shard_id == "q":
            return 0, self.q_size
        if shard_id == "k":
            return self.q_size, self.kv_size
        if shard_id == "v":
            return self.q_size + self.kv_size, self.kv_size
        raise ValueError(f"unknown qkv shard {shard_id!r}")

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused matrix
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_range(shard_id)
        target = param.data.narrow(0, offset, size)
        _check_shape(f"{shard_id}_proj", target, loaded_weight)
        target.copy_(loaded_weight)
