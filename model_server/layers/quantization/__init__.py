"""Quantized weights: the `QuantizedWeight` contract (base.py) and its formats."""

from model_server.layers.quantization.base import QuantizedWeight
from model_server.layers.quantization.int8 import Int8Weight, quantize_int8

__all__ = ["Int8Weight", "QuantizedWeight", "quantize_int8"]
