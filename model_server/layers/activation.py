"""Gated MLP activations: act(x[..., :d]) * x[..., d:] on the fused gate_up output.

SiluAndMul is the `KernelTable` the layer was built with (`silu_and_mul`): PyTorch's by default
(kernels/portable.py), the fused Triton kernel on CUDA. It returns a new tensor and follows
`silu_and_mul_torch`'s numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up (Llama, Mistral, Qwen MLPs)."""

    def __init__(self, *, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: gelu(gate) * up, exact erf or tanh approximation; the tanh one
    (Gemma's GeGLU) on the table's `gelu_tanh_and_mul`."""

    def __init__(self, approximate: str = "none", *, kernels: KernelTable = TORCH_KERNELS) -> None:
        super().__init__()
        self.approximate = approximate
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "tanh":
            return self.kernels.gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


def get_act_and_mul_fn(hidden_act: str, kernels: KernelTable = TORCH_KERNELS) -> nn.Module:
    """The gated activation for an HF `hidden_act` name; ValueError for unsupported ones.
    (The exact GELU has no kernel slot: it runs PyTorch's ops.)"""
    name = hidden_act.lower()
    if name in ("silu", "swish"):
        return SiluAndMul(kernels=kernels)
    if name == "gelu":
        return GeluAndMul("none", kernels=kernels)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh", kernels=kernels)
    raise ValueError(
        f"unsupported hidden_act {hidden_act!r}; supported: silu, gelu, gelu_pytorch_tanh"
    )
