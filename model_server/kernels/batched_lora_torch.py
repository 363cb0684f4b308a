"""Batched LoRA in PyTorch: the portable `KernelTable.lora_add` (devices without a native LoRA
kernel), and `LoRARows`, a step's rows as every `lora_add` reads them.

`lora_add(x [T, in], out [T, out], rows, stacked)` adds to `out` in place, for each row whose
slot is s >= 0, the slot's product (x A_s^T) B_s (the scale is in B; kernels/lora_weights.py's
StackedLoRA holds the slots), summed in float32, rounded to `out`'s dtype. Base-model rows
(slot -1) and slices of rank 0 are left as they are. The one table slot that writes an input:
`out` is the wrapped layer's fresh output (model_server/lora/layers.py's LoRALinear).

PyTorch's form (`lora_add_torch`): a long run of one adapter's rows (a prefill chunk) gets that
slot's shrink and expand on its slice of the batch; the short runs (decodes) punica's batched
form with a zero slot for the base model: the shrink of every slot at once ([rows, S n R]),
masked to each row's own slot, then one expand per slice over all slots. The Triton form
(kernels/batched_lora.py) reads only the rows' slots on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_server.kernels.lora_weights import StackedLoRA

# A run of at least this many consecutive rows of one adapter (a prefill chunk) runs as its own
# shrink/expand on a slice of the batch; shorter runs (decodes) share the masked form.
MIN_SEGMENT_ROWS = 8


@dataclass(slots=True)
class RowGroups:
    """PyTorch's grouping of a step's rows.

    `segments`: (start, end, slot) runs of rows [start, end) of one adapter, each run alone.
    `masked`: the rows [lo, hi) holding every shorter run, with `onehot` [hi - lo, S] (float32,
    on the device): 1 at (row, its slot) for those runs' rows, zeros elsewhere (base-model rows
    and rows of segments); `mask(w)` widens it to [hi - lo, S * w], each slot's 1 repeated over
    its w columns (cached: every layer of the step of one width reads the same)."""

    segments: list[tuple[int, int, int]]
    masked: tuple[int, int] | None = None
    onehot: torch.Tensor | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, token_slots: list[int], num_slots: int, device: torch.device | str) -> RowGroups:
        runs: list[tuple[int, int, int]] = []  # (start, end, slot) of consecutive equal slots
        for row, slot in enumerate(token_slots):
            if runs and runs[-1][2] == slot and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + 1, slot)
            else:
                runs.append((row, row + 1, slot))
        groups = cls(segments=[])
        short: list[tuple[int, int, int]] = []
        for run in runs:
            if run[2] < 0:
                continue
            (groups.segments if run[1] - run[0] >= MIN_SEGMENT_ROWS else short).append(run)
        if short:
            lo, hi = short[0][0], short[-1][1]
            onehot = torch.zeros(hi - lo, num_slots)
            for start, end, slot in short:
                onehot[start - lo : end - lo, slot] = 1.0
            groups.masked, groups.onehot = (lo, hi), onehot.to(device)
        return groups

    def mask(self, width: int) -> torch.Tensor:
        mask = self._masks.get(width)
        if mask is None:
            assert self.onehot is not None
            mask = self._masks[width] = self.onehot.repeat_interleave(width, dim=1)
        return mask


@dataclass(slots=True)
class LoRARows:
    """A step's rows for `lora_add`, made once per step (by the LoRA manager's batch) and read
    by every wrapped layer.

    `slots` [T] int32 on the model's device: each flat row's slot, -1 for the base model (the
    Triton kernels' input: one host-to-device copy per step, not per layer). `host_slots`: the
    same on the host. PyTorch's grouping (`groups()`) is made on first use, so a platform whose
    kernel never asks pays nothing for it."""

    host_slots: list[int]
    num_slots: int
    slots: torch.Tensor
    _groups: RowGroups | None = None

    @classmethod
    def build(cls, token_slots: list[int], num_slots: int, device: torch.device | str) -> LoRARows:
        slots = torch.tensor(token_slots, dtype=torch.int32).to(device)
        return cls(list(token_slots), num_slots, slots)

    def groups(self) -> RowGroups:
        if self._groups is None:
            device = self.slots.device
            self._groups = RowGroups.build(self.host_slots, self.num_slots, device)
        return self._groups


def lora_add_torch(
    x: torch.Tensor, out: torch.Tensor, rows: LoRARows, stacked: StackedLoRA
) -> None:
    """`KernelTable.lora_add` in PyTorch (see the module docstring)."""
    groups = rows.groups()
    for start, end, slot in groups.segments:
        out[start:end] += stacked.delta(x[start:end], slot).to(out.dtype)
    if groups.masked is None:
        return
    lo, hi = groups.masked
    num_slots, width, r = stacked.max_loras, stacked.a.shape[1], stacked.max_rank
    a = stacked.a.view(num_slots * width, -1).float()  # [S n R, in]
    # [rows, S, n, R] with other slots' columns zeroed
    h = ((x[lo:hi].float() @ a.t()) * groups.mask(width)).view(hi - lo, num_slots, -1, r)
    parts = [
        h[:, :, i].reshape(hi - lo, num_slots * r)
        @ stacked.b[:, :, offset : offset + size].reshape(num_slots * r, size).float()
        for i, (offset, size) in enumerate(stacked.slices)
    ]
    out[lo:hi] += torch.cat(parts, dim=1).to(out.dtype)
