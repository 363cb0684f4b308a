"""Quantize a loaded model in place (`--quantization int8`; the format is layers/quantization/).

It lives above the layers because it walks a whole model for the layer classes that hold matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.config import QUANTIZATION_METHODS
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.linear import LinearBase
from model_server.layers.quantization import quantize_int8


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize every linear layer and the LM head of a loaded model in place. The float weights
    are released (a tied embedding keeps its own)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {method!r}")
    for module in list(model.modules()):
        if isinstance(module, LinearBase | ParallelLMHead) and isinstance(
            module.weight, torch.Tensor
        ):
            quantized = quantize_int8(module.weight)
            del module.weight  # this module's reference only: a tied embedding keeps the table
            module.weight = quantized
