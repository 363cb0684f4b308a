"""Linear layers with vLLM's names, tensor-parallel sharding and weight-loading hooks.

Under tensor parallelism (see `model_server.distributed`) each rank holds a shard:
  - ColumnParallelLinear: rows of W (output features); its output stays sharded.
  - RowParallelLinear: columns of W (input features); partial outputs are all-reduced.
  - MergedColumnParallelLinear (gate_up) and QKVParallelLinear: several HF matrices stacked along
    the output dim, sharded per part (rank r holds gate_r | up_r, or q_r | k_r | v_r), so the
    local matmul output splits exactly like the unsharded one.
Every parameter carries `weight_loader(param, full_checkpoint_tensor[, shard_id])`, which copies
this rank's slice: a rank never keeps more than its shard. With one rank nothing is split and
no collective runs.

Parameters are allocated with `torch.empty` (no init pass: checkpoints or
`init_dummy_weights` fill them), on the default device and dtype, and never require grad.

The matmul is the `KernelTable` the layer was built with (`kernels.linear`, or
`kernels.int8_linear` once `--quantization int8` swapped the weight): the platform's choice,
handed down by the model builder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_server.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from model_server.distributed.partition import HeadShard, divide, shard_heads
from model_server.kernels.planned_weight import PlannedWeight
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.quantization import QuantizedWeight
from model_server.layers.quantization.base import LinearQuantMethod, linear_quant_method


def dense(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight | PlannedWeight,
    bias: torch.Tensor | None = None,
    *,
    kernels: KernelTable,
) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T + bias: every linear layer and the LM head call this.

    `weight` is a float tensor (the table's `linear`), a `QuantizedWeight` (`--quantization
    int8`, or a checkpoint kept in its quantized format), which runs its own kernel-table slot,
    or a `PlannedWeight`, which runs the kernels the platform planned for it.
    """
    if isinstance(weight, torch.Tensor):
        return kernels.linear(x, weight, bias)
    return weight.apply(x, bias, kernels)


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


def _copy_rows(
    target: torch.Tensor, loaded: torch.Tensor, start: int, total: int, name: str, dim: int = 0
) -> None:
    """Copy this rank's slice loaded[start : start + target.shape[dim]] (along `dim`) into
    target, after checking `loaded` is the whole tensor (`total` long along `dim`)."""
    expected = list(target.shape)
    expected[dim] = total
    if list(loaded.shape) != expected:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )
    target.copy_(loaded.narrow(dim, start, target.shape[dim]))


class LinearBase(nn.Module):
    """y = x W^T + b with this rank's W: [output_size, input_size] (local sizes)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        # A checkpoint kept quantized (GPTQ, AWQ): its tensors instead of a float weight, until
        # `quant_method.process_weights_after_loading` sets `weight` to a QuantizedWeight.
        self.quant_method: LinearQuantMethod | None = linear_quant_method()
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
        else:
            self.make_float_weights()
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(output_size), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def make_float_weights(self) -> None:
        """A float `weight` [output_size, input_size] (also in place of a quantized
        checkpoint's tensors, for a layer it left unquantized: `modules_to_not_convert`)."""
        for name in [n for n in self._parameters if n != "bias"]:
            del self._parameters[name]
        self.__dict__.pop("_g_idx_parts", None)
        self.quant_method = None
        self.weight = nn.Parameter(
            torch.empty(self.output_size, self.input_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        """Where a checkpoint matrix's output rows go on this rank: (offset in this layer's
        output, rows, first row taken from the checkpoint tensor, its total rows), for the
        part `shard_id` of a fused layer (None: the whole matrix). Quantized checkpoints'
        loaders (layers/quantization/) slice their packed tensors with it."""
        return 0, self.output_size, 0, self.output_size

    def input_shard(self) -> tuple[int, int, int]:
        """This rank's input features: (first, count, total of the checkpoint matrix)."""
        return 0, self.input_size, self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, kernels=self.kernels)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}" + (
            f", tp={self.tp_rank}/{self.tp_size}" if self.tp_size > 1 else ""
        )


class ReplicatedLinear(LinearBase):
    """A plain linear layer (whole matrix on every rank)."""


class RowParallelLinear(LinearBase):
    """Splits the input dim (o_proj, down_proj): x [T, in_local] -> all-reduced [T, out].

    `input_partition=(start, size)` gives this rank's input features when they are not an even
    split (o_proj after uneven head groups); the bias is whole and added after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_partition: tuple[int, int] | None = None,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        if input_partition is None:
            local = divide(input_size, tp_size, "input features of a row-parallel layer")
            input_partition = (get_tensor_model_parallel_rank() * local, local)
        self.input_start = input_partition[0]
        self.total_input_size = input_size
        super().__init__(input_partition[1], output_size, bias, kernels=kernels)
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size == 1:
            default_weight_loader(param, loaded_weight)
        else:
            _copy_rows(
                param.data, loaded_weight, self.input_start, self.total_input_size, "weight", 1
            )

    def input_shard(self) -> tuple[int, int, int]:
        return self.input_start, self.input_size, self.total_input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return dense(x, self.weight, self.bias, kernels=self.kernels)
        out = tensor_model_parallel_all_reduce(
            dense(x, self.weight, kernels=self.kernels)
        )  # [T, out]
        if self.bias is not None:
            out += self.bias
        return out


class ColumnParallelLinear(LinearBase):
    """Splits the output dim evenly: x [T, in] -> [T, out / tp] (this rank's columns)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        local = divide(output_size, tp_size, "output features of a column-parallel layer")
        super().__init__(input_size, local, bias, kernels=kernels)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        local = param.shape[0]
        _copy_rows(param.data, loaded_weight, self.tp_rank * local, self.tp_size * local, "weight")

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        local = self.output_size
        return 0, local, self.tp_rank * local, self.tp_size * local


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices with the same input stacked along the output dim.

    Used for gate_up_proj: shard 0 is gate_proj, shard 1 is up_proj. Each part is split evenly
    over the ranks, so the local output is [T, sum(output_sizes) / tp] laid out gate_r | up_r.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = list(output_sizes)  # whole-model sizes
        self.local_sizes = [
            divide(size, tp_size, "intermediate_size") for size in self.output_sizes
        ]
        super().__init__(input_size, sum(self.local_sizes), bias, kernels=kernels)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the fused matrix
            if self.tp_size == 1:
                default_weight_loader(param, loaded_weight)
                return
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), i)
                offset += size
            return
        size = self.local_sizes[shard_id]
        target = param.data.narrow(0, sum(self.local_sizes[:shard_id]), size)
        total = self.output_sizes[shard_id]
        _copy_rows(target, loaded_weight, self.tp_rank * size, total, f"shard {shard_id}")

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError("a fused gate_up checkpoint tensor cannot be split over ranks")
            return super().output_shard()
        assert isinstance(shard_id, int)
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        return offset, size, self.tp_rank * size, self.output_sizes[shard_id]


class QKVParallelLinear(LinearBase):
    """q_proj, k_proj and v_proj fused: output [T, (H + 2 * Hkv) * D] laid out q | k | v, where
    H and Hkv are this rank's heads (see `model_server.distributed.partition.shard_heads`)."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        self.shard: HeadShard = shard_heads(
            total_num_heads,
            total_num_kv_heads,
            get_tensor_model_parallel_world_size(),
            get_tensor_model_parallel_rank(),
        )
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = self.shard.num_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, kernels=kernels)

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        """(offset, size) of shard "q", "k" or "v" along this rank's output dim."""
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
            if self.tp_size == 1:
                default_weight_loader(param, loaded_weight)
                return
            q, kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            for sid, offset, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), sid)
            return
        offset, size = self.shard_range(shard_id)
        target = param.data.narrow(0, offset, size)
        d = self.head_size
        if shard_id == "q":
            start, total = self.shard.q_start * d, self.total_num_heads * d
        else:
            start, total = self.shard.kv_start * d, self.total_num_kv_heads * d
        _copy_rows(target, loaded_weight, start, total, f"{shard_id}_proj")

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError("a fused qkv checkpoint tensor cannot be split over ranks")
            return super().output_shard()
        assert isinstance(shard_id, str)
        offset, size = self.shard_range(shard_id)
        d = self.head_size
        if shard_id == "q":
            return offset, size, self.shard.q_start * d, self.total_num_heads * d
        return offset, size, self.shard.kv_start * d, self.total_num_kv_heads * d
