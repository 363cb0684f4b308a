"""The `Attention` module models call: reshapes, splits the layer's KV cache and runs a backend."""

from __future__ import annotations

import torch
from torch import nn

from model_server.kernels.kv_cache_dtype import QuantizedKVCache
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one layer, through an `AttentionBackend` instance.

    forward(q [T, H*D] or [T, H, D], k and v [T, Hkv*D] or [T, Hkv, D], kv_cache, metadata)
    -> [T, H*D]. `kv_cache` is the layer's tensor [2, num_blocks, block_size, Hkv, D] (index 0
    keys, 1 values), or a `QuantizedKVCache` (those codes plus their scales
    [2, num_blocks, block_size, Hkv]); the backend writes this step's k/v into it before
    attending.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: type[AttentionBackend],
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_group: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Which KV cache group's block table this layer reads (AttentionMetadata.for_group):
        # set by the model runner when sliding layers get their own block pool.
        self.kv_group = kv_group
        extra: dict[str, object] = {}
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            extra["logits_soft_cap"] = logits_soft_cap
        self.impl = attn_backend(num_heads, num_kv_heads, head_dim, scale, **extra)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | QuantizedKVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        md = attn_metadata.for_group(self.kv_group)
        if isinstance(kv_cache, QuantizedKVCache):
            data, scales = kv_cache.data, kv_cache.scales
            out = self.impl.forward(
                q,
                k,
                v,
                data[0],
                data[1],
                md,
                k_scales=scales[0],
                v_scales=scales[1],
                kv_fixed_scale=kv_cache.fixed_scale,
            )
        else:
            out = self.impl.forward(q, k, v, kv_cache[0], kv_cache[1], md)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.impl.name}"
            + (f", sliding_window={self.sliding_window}" if self.sliding_window else "")
        )
