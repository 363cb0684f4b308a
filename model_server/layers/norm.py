"""RMSNorm, with the residual add fused in (vLLM's `norm(x, residual)` convention).

The computation goes through module-level implementations, PyTorch's by default (every platform
and the tests); `set_rms_norm_impl` installs others, e.g. the fused Triton kernels
(`layers.fused_ops.enable_triton_fused_ops`). An implementation must follow the PyTorch ones'
numerics and contract: it returns new tensors and never writes its inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# (x [..., N], weight [N], eps) -> weight * normalised x
RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
FusedAddRMSNormFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama numerics: the statistics in float32, the normalized value cast back to the input
    dtype, then scaled by the weight."""
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in the inputs' dtype) -> (rms_norm(s), s)."""
    x = x + residual
    return rms_norm_torch(x, weight, eps), x


_rms_norm_impl: RMSNormFn = rms_norm_torch
_fused_add_rms_norm_impl: FusedAddRMSNormFn = fused_add_rms_norm_torch


def set_rms_norm_impl(
    rms_norm: RMSNormFn | None, fused_add_rms_norm: FusedAddRMSNormFn | None
) -> None:
    """Install the platform's RMSNorm implementations (None restores the PyTorch ones)."""
    global _rms_norm_impl, _fused_add_rms_norm_impl
    _rms_norm_impl = rms_norm or rms_norm_torch
    _fused_add_rms_norm_impl = fused_add_rms_norm or fused_add_rms_norm_torch


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim.

    Numerics follow HF Llama: the statistics are computed in float32, the normalized value is cast
    back to the input dtype, then scaled by the weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
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
            return _rms_norm_impl(x, self.weight, self.variance_epsilon)
        return _fused_add_rms_norm_impl(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
