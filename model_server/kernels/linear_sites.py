"""What a platform may tune its matmuls for once the model is built: every linear weight of the
model (and the LM head), with the most rows it will ever multiply (`Platform.plan_linears`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class LinearSite:
    """One linear layer's weight as the layer hands it to `KernelTable.linear` (or, quantized,
    to `.int8_linear` / `.wna16_linear`).

    `weight`: the float weight [N, K] (the parameter itself), or the int8 codes [N, K] with
    `scale` [N] bf16, or a GPTQ/AWQ weight's wNa16 codes (uint8, kernels/portable.py) with
    `scale` its scales [N, G], `offsets`, `bits` and `group_size`. `max_rows`: the most rows
    of x per call (the step's token budget; the number of sampled rows for the LM head).
    `exclusive`: no other module reads the weight (a tied embedding does), so a platform may
    move its values into another layout and keep only that. A GGUF weight kept in its blocks
    gives one site per row segment: `weight` its blocks (uint8 [N, row_bytes]), `ggml_type`
    their type and `k` the float matrix's K (for `KernelTable.gguf_linear`). `module`: the
    linear layer's name in the model (its `weight` is `holder`: the tensor, or the quantized
    weight the codes belong to), where the platform's plan installs a planned weight.
    """

    weight: torch.Tensor
    max_rows: int
    exclusive: bool
    scale: torch.Tensor | None = None
    name: str = ""
    offsets: torch.Tensor | None = None  # wNa16 only
    bits: int = 0  # wNa16 only: 4 or 8
    group_size: int = 0  # wNa16 only
    ggml_type: int | None = None  # GGUF only
    k: int = 0  # GGUF only
    lm_head: bool = False  # the LM head: outside the decoder layers' native step
    module: str = ""
    holder: Any = None

    def matrix_shape(self) -> tuple[int, int]:
        """(N, K) of the float matrix the weight stands for (packed codes and GGUF blocks hold
        K in fewer columns)."""
        n, k = self.weight.shape
        if self.ggml_type is not None:
            k = self.k
        elif self.bits:
            k = k * 8 // self.bits
        return int(n), int(k)
