"""RMSNorm and LayerNorm, with the residual add fused in (vLLM's `norm(x, residual)` convention).

The computation is the `KernelTable` the layer was built with (`rms_norm`, `fused_add_rms_norm`,
`layer_norm`, `fused_add_layer_norm`):
PyTorch's by default (kernels/portable.py), the fused Triton kernels on CUDA. Every
implementation follows the PyTorch ones' numerics and contract: it returns new tensors and never
writes its inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim.

    Numerics follow HF Llama: the statistics are computed in float32, the normalized value is cast
    back to the input dtype, then scaled by the weight.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, kernels: KernelTable = TORCH_KERNELS
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s).

        x may be a strided view (Qwen3's q/k norm gets per-head [T, H, D] views of the fused
        qkv projection); the results are new tensors and x, residual are never written.
        """
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.variance_epsilon)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class LayerNorm(nn.LayerNorm):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (bias optional), on the
    table's kernels: torch's nn.LayerNorm (its parameters and checkpoint names) with vLLM's
    `norm(x, residual)` convention. On the CPU's native table it runs layer_ops.c's kernel, the
    one the native decoder step runs, so the two paths give the same bits."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__(hidden_size, eps=eps, bias=bias)
        self.kernels = kernels

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s)."""
        if residual is None:
            return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return self.kernels.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
