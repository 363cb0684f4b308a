"""Paged attention with Triton kernels (the CUDA backend; runs on CPU under TRITON_INTERPRET=1).

One forward is at most four launches: store K/V, decode attention (+ the split reduce when the
context is split), prefill attention. Everything the launches need on the host comes from the
metadata's host ints and lists, so forward never syncs the device.
"""

from __future__ import annotations

import torch

from model_server.kernels.paged_decode import choose_num_splits, paged_decode_attention
from model_server.kernels.paged_prefill import paged_prefill_attention
from model_server.kernels.store_kv import store_kv_cache
from model_server.kernels.triton_compat import require_supported_triton
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata

# Decode programs wanted per SM before splitting the context stops paying off.
_PROGRAMS_PER_SM = 4
# Stand-in SM count off CUDA (the Triton interpreter), so split-K is exercised on the CPU too.
_DEFAULT_SM_COUNT = 16


class TritonAttentionBackend(AttentionBackend):
    """Decodes: `paged_decode_attention`; prefills: `paged_prefill_attention` (see kernels/).

    `decode_min_split_tokens` / `max_decode_splits` bound the flash-decoding split of long
    contexts (tests lower them to force the split-K path on small shapes).
    """

    name = "triton"
    supports_graphs = True
    supports_sliding_window = True
    supports_logits_soft_cap = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        decode_min_split_tokens: int = 256,
        max_decode_splits: int = 16,
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
        require_supported_triton()  # a clear error here, not an AttributeError at a launch
        self.decode_min_split_tokens = decode_min_split_tokens
        self.max_decode_splits = max_decode_splits
        self._sm_count: int | None = None

    def _target_programs(self, device: torch.device) -> int:
        if self._sm_count is None:
            from model_server.platforms import platform_class

            # A host-side driver query, cached: no device sync.
            units = platform_class(device.type).compute_units(device)
            self._sm_count = units or _DEFAULT_SM_COUNT
        return _PROGRAMS_PER_SM * self._sm_count

    def decode_splits(self, num_seqs: int, max_len: int, device: torch.device) -> int:
        """The split-K of a decode batch whose longest context is (at most) `max_len`."""
        if self.sliding_window is not None:
            max_len = min(max_len, self.sliding_window)  # what a split may cover
        return choose_num_splits(
            num_seqs,
            self.num_kv_heads,
            max_len,
            min_split_tokens=self.decode_min_split_tokens,
            max_splits=self.max_decode_splits,
            target_programs=self._target_programs(device),
        )

    def graph_context_bounds(
        self, num_seqs: int, max_model_len: int, device: torch.device
    ) -> list[int]:
        """decode_min_split_tokens times powers of two below max_model_len, then max_model_len,
        keeping the largest bound of each split count (the split count grows with the bound):
        a batch replays at most twice the splits its longest context would choose."""
        candidates = []
        bound = self.decode_min_split_tokens
        while bound < max_model_len:
            candidates.append(bound)
            bound *= 2
        candidates.append(max_model_len)
        largest: dict[int, int] = {}
        for bound in candidates:  # ascending: a later bound of the same count replaces
            largest[self.decode_splits(num_seqs, bound, device)] = bound
        return sorted(largest.values())

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
        store_kv_cache(
            k, v, k_cache, v_cache, metadata.slot_mapping, k_scales, v_scales, kv_fixed_scale
        )
        return self.attend(q, k_cache, v_cache, metadata, k_scales=k_scales, v_scales=v_scales)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        kv_fixed_scale: float | None = None,
    ) -> torch.Tensor:
        """The attention part of `forward` (K/V already stored): decode, then prefill kernels."""
        md = metadata
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = md.num_decodes
        if nd:
            # Decodes are the first nd tokens and the first nd requests (one token each).
            num_splits = self.decode_splits(nd, max(md.seq_lens_cpu[:nd]), q.device)
            paged_decode_attention(
                out[:nd],
                q[:nd],
                k_cache,
                v_cache,
                md.seq_lens[:nd],
                md.block_tables[:nd],
                self.scale,
                max(md.seq_lens_cpu[:nd]),
                num_splits,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                k_scales=k_scales,
                v_scales=v_scales,
            )
        if md.num_prefills:
            paged_prefill_attention(
                out,
                q,
                k_cache,
                v_cache,
                md.query_start_loc,
                md.seq_lens,
                md.block_tables,
                self.scale,
                nd,
                md.num_prefills,
                md.max_query_len,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                k_scales=k_scales,
                v_scales=v_scales,
            )
        return out
