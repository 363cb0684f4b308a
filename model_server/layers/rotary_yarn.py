"""YaRN rotary scaling (HF `rope_type: yarn`, DeepSeek-V2/V3's long-context rope): interpolated
and extrapolated inverse frequencies blended by a linear ramp over the dims, and cos/sin scaled
by an attention factor. `yarn_softmax_scale` is DeepSeek's extra softmax factor (mscale^2).

Matches transformers' `_compute_yarn_parameters` op for op (float32), so the cos/sin cache holds
the values HF computes. The rotation itself is the kernel table's neox rotary, as for
`layers/rotary.py`'s RotaryEmbedding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(
    dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] float32, attention factor) for a yarn `params` dict."""
    base = float(params["rope_theta"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(params: dict[str, Any], scale: float) -> float:
    """DeepSeek's softmax scale: `scale` times mscale(factor, mscale_all_dim)^2 under a scaled
    rope with `mscale_all_dim`, else `scale`."""
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        return scale * m * m
    return scale


class ScaledRotaryEmbedding(nn.Module):
    """Neox rotary with given inverse frequencies and cos/sin scaled by `attention_factor`:
    forward(positions [T], q [T, H, D], k [T, Hk, D]) -> rotated (q, k), as RotaryEmbedding."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_factor: float,
        max_position: int,
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.head_dim = 2 * inv_freq.shape[0]
        self.max_position = max_position
        t = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = t[:, None] * inv_freq[None, :].cpu()
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        cache = cache.to(device=torch.empty(0).device, dtype=torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rotary_embedding(positions, query, key, self.cos_sin_cache)
