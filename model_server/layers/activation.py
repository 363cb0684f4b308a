"""Gated MLP activations: act(x[..., :d]) * x[..., d:] on the fused gate_up output.

SiluAndMul goes through a module-level implementation, PyTorch's by default (every platform and
the tests); `set_silu_and_mul_impl` installs another, e.g. the fused Triton kernel
(`layers.fused_ops.enable_triton_fused_ops`). It must return a new tensor and follow
`silu_and_mul_torch`'s numerics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# x [..., 2d] -> [..., d]
SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up, each op rounding to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_silu_and_mul_impl: SiluAndMulFn = silu_and_mul_torch


def set_silu_and_mul_impl(fn: SiluAndMulFn | None) -> None:
    """Install the platform's SiluAndMul (None restores `silu_and_mul_torch`)."""
    global _silu_and_mul_impl
    _silu_and_mul_impl = fn or silu_and_mul_torch


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up (Llama, Mistral, Qwen MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _silu_and_mul_impl(x)


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
