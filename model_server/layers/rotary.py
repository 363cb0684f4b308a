"""Rotary position embedding (neox style, the HF Llama layout) with a precomputed cos/sin cache.

Supported scalings (HF `rope_type`): default (none), linear, llama3, and Phi-3's longrope (alias
su). Others raise ValueError. A `partial_rotary_factor` < 1 (Phi-2, StableLM, GLM-4) rotates the
first `head_dim * factor` dims of each head and passes the rest through.
HF keeps the settings in `config.rope_parameters` (transformers >= 5, `rope_theta` inside) or in
`config.rope_theta` + `config.rope_scaling` (older); `rope_parameters_from_config` reads both.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from model_server.kernels.table import TORCH_KERNELS, KernelTable

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters_from_config(config: Any) -> dict[str, Any]:
    """One flat dict with at least `rope_type` and `rope_theta`, from either HF convention."""
    params: dict[str, Any] = {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    new_style = getattr(config, "rope_parameters", None)
    if isinstance(new_style, dict):
        params.update(new_style)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    # Old checkpoints spell the type "type"; "none"/None mean no scaling.
    rope_type = params.get("rope_type", params.get("type")) or "default"
    rope_type = "default" if rope_type == "none" else rope_type
    params["rope_type"] = "longrope" if rope_type == "su" else rope_type
    partial = getattr(config, "partial_rotary_factor", None)
    if "partial_rotary_factor" not in params and partial:
        params["partial_rotary_factor"] = partial
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled per `params["rope_type"]`.

    Matches transformers' ROPE_INIT_FUNCTIONS for the supported types (same float32 ops, so the
    cos/sin values are bitwise those HF computes).
    """
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "longrope":
        raise ValueError("longrope has two sets of frequencies: use longrope_inv_freqs")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp
    between (wavelength bounds from original_max_position_embeddings / {low,high}_freq_factor)."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freqs(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Phi-3's LongRoPE: (short inv_freq, long inv_freq, attention factor), as transformers'
    `_compute_longrope_parameters` computes them (the factor scales cos and sin)."""
    base = float(params["rope_theta"])
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    powers = base**exponents
    short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * powers)
    return short, long, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q [T, H, D] and k [T, Hkv, D] at `positions` [T].

    Neox layout: dims [0, D/2) pair with [D/2, D), i.e. HF's `x * cos + rotate_half(x) * sin`.
    `cos_sin_cache` [max_position, D] holds cos in the first half of each row and sin in the
    second, computed in float32 then cast to the default dtype (HF casts cos/sin to the
    activation dtype the same way). Positions must be < max_position. The rotation is the
    `KernelTable`'s `rotary_embedding` (PyTorch's ops by default, one C call on CPUs).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict[str, Any],
        *,
        kernels: KernelTable = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_type = params["rope_type"]
        t = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        if self.rope_type == "longrope":
            # Positions below the original context use the short factors, later ones the long
            # ones, as vLLM does. transformers instead switches the whole sequence to the long
            # factors once it exceeds the original length (its Phi-3 generate drops the cache
            # and recomputes everything there), which a paged cache with shared prefixes cannot
            # do: outputs past that length differ from its.
            short, long, attention_factor = longrope_inv_freqs(
                head_dim, params, int(params["max_position_embeddings"])
            )
            original = int(params["original_max_position_embeddings"])
            inv = torch.where(t[:, None] < original, short[None, :], long[None, :])
            freqs = t[:, None] * inv  # [max_position, D/2]
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        else:
            inv_freq = compute_inv_freq(head_dim, params)
            freqs = t[:, None] * inv_freq[None, :]  # [max_position, D/2]
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        # Built on the CPU in float32 (as HF does), then moved to the default device and dtype
        # (honours `with torch.device(...)`; a meta cache would stay unusable, so models are not
        # built on meta). Non-persistent: checkpoints do not carry it.
        cache = cache.to(device=torch.empty(0).device, dtype=torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H, D], key [T, Hkv, D] (views of the fused qkv projection) -> new
        contiguous rotated (query, key)."""
        return self.kernels.rotary_embedding(positions, query, key, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, type={self.rope_type}"


class PartialRotaryEmbedding(nn.Module):
    """Rotates the first `rotary.head_dim` dims of each head (neox layout within them) and
    passes the other dims through: q [T, H, D], k [T, Hkv, D] -> new contiguous (q, k)."""

    def __init__(self, rotary: RotaryEmbedding, head_dim: int) -> None:
        super().__init__()
        self.rotary = rotary
        self.head_dim = head_dim
        self.rotary_dim = rotary.head_dim

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, query[..., :r], key[..., :r])
        return torch.cat((q_rot, query[..., r:]), -1), torch.cat((k_rot, key[..., r:]), -1)


def get_rope(
    head_dim: int,
    max_position: int,
    config: Any,
    kernels: KernelTable = TORCH_KERNELS,
    params: dict[str, Any] | None = None,
) -> RotaryEmbedding | PartialRotaryEmbedding:
    """The rotary embedding an HF config asks for, with a cache of `max_position` positions.
    `params` overrides the config's rope parameters (Gemma 3's local layers have their own)."""
    if params is None:
        params = rope_parameters_from_config(config)
    params = dict(params)
    params.setdefault(
        "max_position_embeddings", getattr(config, "max_position_embeddings", max_position)
    )
    if params["rope_type"] == "longrope" and not params.get("original_max_position_embeddings"):
        # Phi-3 configs keep it at the top level.
        params["original_max_position_embeddings"] = config.original_max_position_embeddings
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    rope = RotaryEmbedding(rotary_dim, max_position, params, kernels=kernels)
    return rope if rotary_dim == head_dim else PartialRotaryEmbedding(rope, head_dim)
