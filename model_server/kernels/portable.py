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


def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """x [..., N], weight [N], bias [N] or None -> (x - mean) / sqrt(var + eps) * weight + bias
    over the last dim (torch's layer_norm: fp32 statistics, one rounding to x's dtype)."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def fused_add_layer_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in the inputs' dtype) -> (layer_norm(s), s)."""
    x = x + residual
    return layer_norm_torch(x, weight, bias, eps), x


def gelu_torch(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x), "none" (erf) or "tanh" approximation, rounded to x's dtype (the plain MLPs of
    Phi-2 and StarCoder2)."""
    return F.gelu(x, approximate=approximate)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up, each op rounding to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: gelu(gate, tanh approximation) * up, each op rounding to x's
    dtype (GeGLU: Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> [B] int64: each row's largest, the first on ties, a
    NaN counting as the largest (torch.argmax)."""
    return logits.argmax(dim=-1)


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


# ---- wNa16: 4- and 8-bit weights with per-group scales and offsets (GPTQ, AWQ) ----------------
#
# The one layout every wNa16 kernel reads (layers/quantization/wna16.py fills it from either
# checkpoint format). W [N, K] is cut along K into groups of `group_size` (K itself for
# per-channel); group g of row n dequantizes as
#     W[n, k] = scales[n, g] * q[n, k] + offsets[n, g]          (float32; g = k // group_size)
# where q is the unsigned code (0..15 or 0..255) and offsets = -scale * zero folds the zero point
# in. Codes are uint8: [N, K] for 8 bits; for 4 bits [N, K / 2], K cut into blocks of 32, byte j
# (0..15) of a block holding k = 32 b + j in its low nibble and k = 32 b + 16 + j in its high one,
# so that one 16-byte load yields 32 consecutive k as two runs of 16 (a zmm each, or 2 ymm).
WNA16_BLOCK = 32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integer codes 0..15, K a multiple of 32 -> [N, K / 2] uint8 in the wNa16 layout."""
    n, k = q.shape
    if k % WNA16_BLOCK:
        raise ValueError(f"4-bit codes need K a multiple of {WNA16_BLOCK}, got {k}")
    blocks = q.to(torch.uint8).view(n, k // WNA16_BLOCK, 2, WNA16_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 (wNa16 layout) -> q [N, K] uint8 codes 0..15."""
    n, half = codes.shape
    blocks = codes.view(n, half // (WNA16_BLOCK // 2), WNA16_BLOCK // 2)
    return torch.stack((blocks & 0xF, blocks >> 4), dim=2).reshape(n, half * 2)


def dequantize_wna16(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """codes (see above), scales and offsets [N, G] float32, G = ceil(K / group_size) -> W [N, K]
    in `dtype` (computed in float32, then cast)."""
    q = unpack_int4(codes) if bits == 4 else codes
    k = q.shape[1]
    g = torch.arange(k, device=q.device) // group_size  # the group of each k
    return (q.float() * scales[:, g] + offsets[:, g]).to(dtype)


def wna16_linear_dequant(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] @ dequantized W^T + bias -> [M, N] in x's dtype: dequantize the whole matrix, then
    the float matmul (the reference every wNa16 kernel is compared with; slow)."""
    w = dequantize_wna16(codes, scales, offsets, bits, group_size, x.dtype)
    return F.linear(x, w, bias)
