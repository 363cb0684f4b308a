"""Quantize a loaded model in place (`--quantization int8`; the format is layers/quantization/),
and finish loading a checkpoint kept quantized (GPTQ, AWQ: `process_weights_after_loading`).

It lives above the layers because it walks a whole model for the layer classes that hold matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.config import QUANTIZATION_METHODS
from model_server.layers.embedding import ParallelLMHead
from model_server.layers.linear import LinearBase
from model_server.layers.quantization import QuantizedWeight, quantize_int8


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


def process_weights_after_loading(model: nn.Module) -> None:
    """Turn the loaded checkpoint tensors of every quantized linear layer (GPTQ, AWQ) into its
    QuantizedWeight; nothing for a float model. Call once, after `model.load_weights`."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase) and method is not None:
            method.process_weights_after_loading(module)


def model_quantization(model: nn.Module) -> str | None:
    """The quantization a model's linear layers run (e.g. "gptq w4 g128", "int8"), None: float."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase) and method is not None:
            return str(getattr(method, "description", method.method))
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            return weight.method
    return None
