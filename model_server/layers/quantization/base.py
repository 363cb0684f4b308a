"""The contract every kept-quantized weight follows, so that `layers.linear.dense` needs no
branch per format.

A `QuantizedWeight` stands in a linear layer's (or the LM head's) `weight` attribute in place of
the float parameter. Formats (`int8.py` for `--quantization int8`; checkpoint formats next to it)
subclass it and say how a matmul runs on their layout, through a slot of the model's
`KernelTable` so that the platform chooses the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

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

    def lookup(self, ids: torch.Tensor, kernels: KernelTable) -> torch.Tensor:
        """Rows `ids` [...] of W -> [..., K], for a format that can stand in an embedding
        table (only the gathered rows are decoded)."""
        raise NotImplementedError(f"{self.method} weights cannot serve embedding lookups")


class LinearQuantMethod(Protocol):
    """How a checkpoint's quantized linear layers are built and loaded (vLLM's "quant method"):
    `create_weights` registers the checkpoint's tensors on a layer in place of its float
    `weight` (this rank's shard, each with a `weight_loader`), and once every tensor is loaded
    `process_weights_after_loading` turns them into the layer's `QuantizedWeight`."""

    method: str

    def create_weights(self, layer: nn.Module) -> None: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None: ...


# The method linear layers built right now take (`models.build_model` sets it for a model whose
# checkpoint is quantized, for the time of the construction only, as it sets torch's default
# dtype and device); None: float weights.
_BUILDING_QUANT: ContextVar[LinearQuantMethod | None] = ContextVar("linear_quant", default=None)


@contextmanager
def building_quantized_linears(method: LinearQuantMethod | None) -> Iterator[None]:
    """Linear layers constructed inside take `method` (None: float weights)."""
    token = _BUILDING_QUANT.set(method)
    try:
        yield
    finally:
        _BUILDING_QUANT.reset(token)


def linear_quant_method() -> LinearQuantMethod | None:
    """The method a linear layer being constructed takes (see `building_quantized_linears`)."""
    return _BUILDING_QUANT.get()
