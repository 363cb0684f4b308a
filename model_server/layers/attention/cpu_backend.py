"""CPU attention: the whole step (decodes and prefill chunks) in one call of the native kernel
(kernels/cpu/paged_attention.c), which stores the step's K/V into the paged cache and reads K/V
from it in place, fp32 or bf16 queries over a cache of their dtype, bf16, or int8 / fp8 codes
with their scales (quantized by the kernel's store; kernels/cpu/wick_kv.h), with the vector ISA
picked from the CPU's flags (kernels/cpu/isa.py).

It replaces the portable path's gather of every request's blocks into a padded copy + masked
SDPA for decodes (3-5x less time at batch 16), and its per-request Python loop of gather + SDPA
for prefills (2-5x less for chunks after a cached prefix and for batches of prompts; about even
for a lone prompt of 1024 tokens, where SDPA's flash kernel is matmul-bound).

Layers with a sliding window (Gemma 2/3, Mistral-style configs) or attention logit soft-capping
(Gemma 2) run the same kernel's windowed entry point: keys before a query's window, and the
blocks holding only such keys (the KV manager's null block once freed), are never read.

When the kernel cannot run (no C compiler, a dtype or head_dim it does not support) the step
goes to the portable backend, after ONE warning per reason saying which kernel and why.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from model_server.kernels.cpu import native
from model_server.layers.attention.backend import AttentionMetadata
from model_server.layers.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)


@cache
def _warn_fallback(reason: str) -> None:
    """Once per process and reason: every layer and step would repeat it."""
    logger.warning(
        "native CPU paged attention (kernels/cpu/paged_attention.c) is not used: %s; "
        "attention runs on the portable PyTorch path (gather + SDPA), which is slower",
        reason,
    )


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        self.kernels = native.load_kernels()  # built once per process and ISA, then cached

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        kv_fixed_scale: float | None = None,
    ) -> torch.Tensor:
        scales = {"k_scales": k_scales, "v_scales": v_scales, "kv_fixed_scale": kv_fixed_scale}
        if self.kernels is None:
            reason = "the kernels could not be built (see the warning above)"
        else:
            reason = native.unsupported_reason(q, k_cache, self.head_dim)
        if reason is not None:
            _warn_fallback(reason)
            return super().forward(q, k, v, k_cache, v_cache, metadata, **scales)
        assert self.kernels is not None
        # k, v: views of the fused qkv projection, stored by the kernel before it attends.
        return native.paged_attention(
            self.kernels,
            q,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.scale,
            k=k,
            v=v,
            slot_mapping=metadata.slot_mapping,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            **scales,
        )
