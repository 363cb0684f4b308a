"""The contract every kept-quantized weight follows, so that `layers.linear.dense` needs no
branch per format.

A `QuantizedWeight` stands in a linear layer's (or the LM head's) `weight` attribute in place of
the float parameter. Formats (`int8.py` for `--quantization int8`; checkpoint formats next to it)
subclass it and say how a matmul runs on their layout, through a slot of the model's
`KernelTable` so that the platform chooses the kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.kernels.table import KernelTable


class QuantizedWeight(nn.Module):
    """A weight W [N, K] stored in some quantized layout.

    Subclasses keep their tensors as parameters without grad, so that `model.parameters()` lists
    every byte a step reads (benchmarks/bandwidth.py counts them).
    """

    # The name shown in logs, /v1/models and the metrics (e.g. "int8", "gptq", "gguf").
    method: str = ""

    @property
    def shape(self) -> torch.Size:
        """(N, K) of the float matrix this stands for."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K] (for references, tests and slow paths)."""
        raise NotImplementedError

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelTable
    ) -> torch.Tensor:
        """x [..., K] @ W^T + bias -> [..., N] in x's dtype."""
        raise NotImplementedError
