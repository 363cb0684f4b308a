"""The LoRA-able linear layers of a model and the wrapper that adds the adapters' products.

Wick fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; PEFT trains `q_proj`,
`k_proj`, ... separately. A PEFT module is a *slice* of a fused layer's output: its B matrix
writes columns [offset, offset + size) of the fused output. Each wrapped layer keeps its device
slots as kernels/lora_weights.py's StackedLoRA (R is --max-lora-rank):

  lora_a [S, n_slices R, in]  slice i's A in rows [i R, i R + r)
  lora_b [S, R, out]          slice i's B transposed (times the adapter's scale) in rows
                              [0, r), its own columns [offset_i, offset_i + size_i)
  lora_ranks [S, n_slices]    r, or 0 where a slot is empty or its adapter leaves the slice

Per step, `LoRABatch` says which rows of the flat batch use which slot (LoRALinear's forward
says how they run: the native CPU kernel, or the kernel table's `lora_add`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model_server.kernels.batched_lora_torch import LoRARows
from model_server.kernels.cpu.lora import lora_add, lora_kernels, lora_struct
from model_server.kernels.lora_weights import StackedLoRA
from model_server.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

# PEFT's module names on the families served (Llama, Qwen, Mistral, Gemma).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True, frozen=True)
class LoRATarget:
    """One fused (or plain) linear layer adapters may train: `module_name` is Wick's
    (`model.layers.0.self_attn.qkv_proj`), `slices` PEFT's module suffix per output slice with
    its (offset, size) in the layer's output."""

    module_name: str
    slices: tuple[tuple[str, int, int], ...]
    in_features: int
    out_features: int

    def peft_names(self) -> dict[str, int]:
        """PEFT module name (`model.layers.0.self_attn.q_proj`) -> slice index."""
        prefix = self.module_name.rsplit(".", 1)[0]
        return {f"{prefix}.{suffix}": i for i, (suffix, _, _) in enumerate(self.slices)}


def find_targets(model: nn.Module) -> list[LoRATarget]:
    """The model's LoRA-able layers: every fused q/k/v and gate/up layer and the o_proj /
    down_proj row-parallel ones of its decoder layers (named as PEFT names HF's modules)."""
    targets: list[LoRATarget] = []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear) or ".layers." not in f".{name}":
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, QKVParallelLinear) and leaf == "qkv_proj":
            slices = tuple((f"{s}_proj", *module.shard_range(s)) for s in ("q", "k", "v"))
        elif isinstance(module, MergedColumnParallelLinear) and leaf == "gate_up_proj":
            gate, up = module.local_sizes
            slices = (("gate_proj", 0, gate), ("up_proj", gate, up))
        elif isinstance(module, RowParallelLinear) and leaf in ("o_proj", "down_proj"):
            slices = ((leaf, 0, module.output_size),)
        else:
            continue
        targets.append(LoRATarget(name, slices, module.input_size, module.output_size))
    return targets


@dataclass(slots=True)
class LoRABatch:
    """This step's adapters, as every wrapped layer reads them (set by the manager per step).

    `token_slots`: each flat row's slot (-1: the base model), int32 on the CPU: what the native
    kernel (kernels/cpu/lora.py) and the native decoder step read. `native`: the layers run that
    kernel (set once by the manager); otherwise `set` also makes `rows`, what the kernel table's
    `lora_add` reads (the slots copied to the device once per step, kernels/
    batched_lora_torch.py). `active`: some row has an adapter."""

    active: bool = False
    native: bool = False
    token_slots: torch.Tensor | None = None
    rows: LoRARows | None = None

    def set(self, token_slots: list[int], num_slots: int, device: torch.device | str) -> None:
        """From each flat row's slot (-1: the base model)."""
        self.clear()
        self.active = any(slot >= 0 for slot in token_slots)
        if not self.active:
            return
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32)
        if not self.native:
            self.rows = LoRARows.build(token_slots, num_slots, device)

    def clear(self) -> None:
        self.active, self.token_slots, self.rows = False, None, None


class LoRALinear(nn.Module):
    """`base`'s output plus each row's adapter's `(x A^T) B^T` (the scale is in B).

    The slots are written by the LoRA manager between steps; `batch` is the manager's, shared
    by every wrapped layer, and set per step. On the CPU (float32 / bfloat16) the native kernel
    runs the step's rows grouped by slot (kernels/cpu/lora.c: the native decoder step calls the
    same one). Elsewhere the base layer's kernel table's `lora_add` (PyTorch's segments and
    masked batched form, kernels/batched_lora_torch.py; Triton's one shrink and one expand
    launch on CUDA, kernels/batched_lora.py)."""

    def __init__(
        self,
        base: LinearBase,
        target: LoRATarget,
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.batch = batch
        self.max_rank = max_rank
        n_slices = len(target.slices)
        self.width = n_slices * max_rank  # n R
        # Buffers, not parameters (no checkpoint loads them), in `dtype`: the manager's choice,
        # bfloat16 for a bfloat16 model on the native kernel (half the bytes a step reads;
        # summed in fp32), else float32 (PyTorch's path: its bf16 CPU matmul takes milliseconds
        # on a few-row [T, 48] x [48, N], a thousand times the float32 one).
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, self.width, target.in_features, device=device, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, max_rank, target.out_features, device=device, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "lora_ranks",
            torch.zeros(max_loras, n_slices, dtype=torch.int32, device=device),
            persistent=False,
        )
        # The slots as the batched kernels read them, made once: the buffers are filled in
        # place (`set_slot`) and never replaced (the model is on its device before the manager
        # wraps it), so their addresses hold.
        slices = tuple((offset, size) for _, offset, size in target.slices)
        self.stacked = StackedLoRA(self.lora_a, self.lora_b, self.lora_ranks, slices)
        # The native kernel's description of the slots (lora_struct), made on first use.
        self._native: Any = None

    def set_slot(
        self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Write an adapter's slices (slice index -> (A [r, in], B [size, r] scaled)) into
        `slot`, zeroing the rest; None clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_ranks[slot].zero_()
        for i, (a, b) in (weights or {}).items():
            _, offset, size = self.target.slices[i]
            r = a.shape[0]
            col = i * self.max_rank
            self.lora_a[slot, col : col + r].copy_(a)
            self.lora_b[slot, :r, offset : offset + size].copy_(b.t())
            self.lora_ranks[slot, i] = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # [T, out]
        batch = self.batch
        if not batch.active:
            return out
        # `out` is the layer's fresh output: its rows are added to in place.
        if batch.native:
            assert batch.token_slots is not None
            kernels = lora_kernels(x)
            assert kernels is not None  # the manager sets `native` only where it runs
            if self._native is None:
                self._native = lora_struct(self.stacked)
            rows = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads unit-stride rows
            lora_add(kernels, rows, out, batch.token_slots, self._native)
            return out
        assert batch.rows is not None
        self.base.kernels.lora_add(x, out, batch.rows, self.stacked)
        return out

    def extra_repr(self) -> str:
        return f"slices={[s for s, _, _ in self.target.slices]}, max_rank={self.max_rank}"
