"""`StackedLoRA`: one linear layer's LoRA adapter slots as the batched LoRA kernels read them
(the CPU's kernels/cpu/lora.c; the layout is wick_lora.h's). The LoRA manager (model_server/lora/)
owns and fills them; a platform's native decoder step points at them once (their addresses never
change: a slot is overwritten in place when an adapter loads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class StackedLoRA:
    """S slots of rank up to R on a layer of `in` inputs and `out` outputs whose output is cut
    into `slices` (offset, size): q | k | v, gate | up, or one slice; PEFT trains each apart.

    a:     [S, n_slices R, in]  slice i's A in rows [i R, i R + rank)
    b:     [S, R, out]          slice i's B transposed, scale folded in, in its columns
    (a and b float32, or bfloat16 for a bfloat16 model on the CPU's native kernel)
    ranks: [S, n_slices] int32          rows each slot's slice runs (0: empty / not trained)
    Rows past a rank and slices an adapter leaves are zeros."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    slices: tuple[tuple[int, int], ...]

    @property
    def max_loras(self) -> int:
        return int(self.a.shape[0])

    @property
    def max_rank(self) -> int:
        return int(self.b.shape[1])

    def __post_init__(self) -> None:
        s, width, _ = self.a.shape
        n_slices = len(self.slices)
        if self.b.shape[0] != s or width != n_slices * self.b.shape[1]:
            raise ValueError(f"LoRA slots: a {tuple(self.a.shape)} and b {tuple(self.b.shape)}")
        if tuple(self.ranks.shape) != (s, n_slices) or self.ranks.dtype != torch.int32:
            raise ValueError(f"LoRA slots: ranks {tuple(self.ranks.shape)} {self.ranks.dtype}")
        end = 0
        for offset, size in self.slices:  # in order, tiling the output
            if offset != end:
                raise ValueError(f"LoRA slices {self.slices} do not tile the output")
            end += size
        if end != self.b.shape[2]:
            raise ValueError(f"LoRA slices {self.slices} do not cover {self.b.shape[2]} outputs")

    def delta(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot `slot`'s product for every row of x [T, in]: [T, out] float32 (PyTorch, the
        reference of the native kernel and the path of devices without one)."""
        h = x.float() @ self.a[slot].float().t()  # [T, n R]
        r = self.max_rank
        parts = [
            h[:, i * r : (i + 1) * r] @ self.b[slot, :, offset : offset + size].float()
            for i, (offset, size) in enumerate(self.slices)
        ]
        return torch.cat(parts, dim=1)
