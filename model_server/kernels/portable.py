"""The portable kernels: plain PyTorch ops, correct on every device (`TORCH_KERNELS` in table.py;
its dense matmul is `F.linear` itself).

They define the numerics every other implementation of the same slot must follow (the fused
Triton kernels, the CPU matmuls): same inputs, same output dtype, new tensors, inputs never
written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """qweight [N, K] int8, scale [N] bf16 -> scale[:, None] * qweight [N, K] in `dtype`
    (the product in float32: bf16 scales widen exactly)."""
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def int8_linear_dequant(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ dequantized(qweight [N, K], scale [N])^T + bias -> [M, N] in x's dtype:
    dequantize the whole matrix, then the float matmul (exact up to its rounding, and slow)."""
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * normalised x. HF Llama numerics: the statistics in
    float32, the normalized value cast back to the input dtype, then scaled by the weight."""
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


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up, each op rounding to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_torch(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding (HF's `x * cos + rotate_half(x) * sin`): query [T, H, D] and key
    [T, Hkv, D] (any strides), positions [T] int, cos_sin_cache [max_position, D] holding cos in
    the first half of each row and sin in the second -> new contiguous (query, key). Dims i and
    D/2 + i pair up; each product and each sum rounds to the inputs' dtype."""
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, D]
    cos, sin = cos_sin.unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, D/2] each
    return _apply_neox(query, cos, sin), _apply_neox(key, cos, sin)


def _apply_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, 1, D/2] -> [T, H, D] (contiguous)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
