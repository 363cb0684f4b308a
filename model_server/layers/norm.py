"""RMSNorm, with the residual add fused in (vLLM's `norm(x, residual)` convention)."""

from __future__ import annotations

import torch
from torch import nn


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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
