"""Gated MLP activations: act(x[..., :d]) * x[..., d:] on the fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up (Llama, Mistral, Qwen MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: gelu(gate) * up, exact erf or tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_and_mul_fn(hidden_act: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name; ValueError for unsupported ones."""
    name = hidden_act.lower()
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name == "gelu":
        return GeluAndMul("none")
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    raise ValueError(
        f"unsupported hidden_act {hidden_act!r}; supported: silu, gelu, gelu_pytorch_tanh"
    )
