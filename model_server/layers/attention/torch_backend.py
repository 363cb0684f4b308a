"""Portable paged attention in plain PyTorch: the reference every other backend is tested against.

Decodes are batched: their blocks are gathered into one padded [B, L, Hkv, D] context and masked
past each `seq_len`. Prefills run one request at a time with a causal mask offset by the number of
tokens already cached (chunked prefill, prefix-cache hits); a prefill with nothing cached attends
to its own fresh K/V without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_server.kernels.kv_cache_dtype import (
    as_bytes,
    dequantize_kv,
    kv_dtype_of,
    quantize_kv,
)
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata


def write_to_paged_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    fixed_scale: float | None = None,
) -> None:
    """k, v: [T, Hkv, D] -> cache slots (k_cache, v_cache: [num_blocks, block_size, Hkv, D]);
    with scales ([num_blocks, block_size, Hkv]) quantized first (kv_cache_dtype.quantize_kv,
    with the layer's static `fixed_scale` where it has one)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_scales is None or v_scales is None:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    kv = kv_dtype_of(k_cache.dtype)
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        codes, s = quantize_kv(x, kv, fixed_scale)
        as_bytes(cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(codes))
        scales.view(-1, num_kv_heads).index_copy_(0, slots, s)


def gather_paged_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """[num_blocks_total, bs, Hkv, D] + [B, >=num_blocks] ids -> [B, num_blocks * bs, Hkv, D]."""
    # index_select over a 2-D view (one row per block) copies whole rows; on 4-D tensors and
    # with int32 indices torch takes much slower per-element paths on CPU.
    ids = block_tables[:, :num_blocks].reshape(-1).to(torch.int64)
    blocks = cache.view(cache.shape[0], -1).index_select(0, ids)  # [B * nb, bs * Hkv * D]
    return blocks.view(block_tables.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])


def gather_kv(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    num_blocks: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """gather_paged_context in `dtype`, dequantized with `scales` [num_blocks_total, bs, Hkv]
    when the cache is quantized."""
    ctx = gather_paged_context(cache, block_tables, num_blocks)
    if scales is None:
        return ctx.to(dtype)
    return dequantize_kv(ctx, gather_paged_context(scales, block_tables, num_blocks), dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_sliding_window = True
    supports_logits_soft_cap = True

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
        write_to_paged_cache(
            k, v, k_cache, v_cache, metadata.slot_mapping, k_scales, v_scales, kv_fixed_scale
        )
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        scales = (k_scales, v_scales)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, metadata, scales)
        qsl = metadata.query_start_loc_cpu
        for i in range(nd, metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, metadata, i, scales
            )
        return out

    def _first_block(self, first_query_pos: int, block_size: int) -> int:
        """The first block a query at `first_query_pos` (or later) can see: 0 without a window.
        Blocks before it may be the KV manager's null block: they are never gathered."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_pos - self.sliding_window + 1) // block_size

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> torch.Tensor:
        nd = q.shape[0]
        block_size = k_cache.shape[1]
        seq_lens = md.seq_lens_cpu[:nd]
        max_len = max(seq_lens)
        num_blocks = -(-max_len // block_size)
        first = self._first_block(min(seq_lens) - 1, block_size)
        tables = md.block_tables[:nd, first:]
        keys = gather_kv(k_cache, scales[0], tables, num_blocks - first, q.dtype)
        values = gather_kv(v_cache, scales[1], tables, num_blocks - first, q.dtype)
        # keys: [nd, L, Hkv, D] for positions [first * block_size, num_blocks * block_size).
        positions = torch.arange(first * block_size, num_blocks * block_size, device=q.device)
        seq_lens_t = md.seq_lens[:nd, None]
        mask = positions[None, :] < seq_lens_t  # [nd, L]
        if self.sliding_window is not None:
            mask &= positions[None, :] >= seq_lens_t - self.sliding_window
        if self.logits_soft_cap is not None:
            return self._soft_capped(
                q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None, None]
            ).squeeze(2)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [nd, H, 1, D]
            keys.transpose(1, 2),  # [nd, Hkv, L, D]
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return attn.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        i: int,
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> torch.Tensor:
        query_len = q.shape[0]
        seq_len = md.seq_lens_cpu[i]
        # Query j sits at position seq_len - query_len + j and sees keys at positions <= it
        # (and, with a window W, > it - W).
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        if seq_len == query_len and scales[0] is None:
            # Nothing cached before this chunk: attention over the fresh K/V (a quantized
            # cache reads them back, so that every token sees the K/V later steps will).
            if self.sliding_window is None and self.logits_soft_cap is None:
                return self._sdpa(q, k, v, mask=None)
            return self._sdpa(q, k, v, mask=self._mask(q_pos, q_pos))
        block_size = k_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        first = self._first_block(seq_len - query_len, block_size)
        table = md.block_tables[i : i + 1, first:]
        length = seq_len - first * block_size
        keys = gather_kv(k_cache, scales[0], table, num_blocks - first, q.dtype)[0, :length]
        values = gather_kv(v_cache, scales[1], table, num_blocks - first, q.dtype)[0, :length]
        k_pos = torch.arange(first * block_size, seq_len, device=q.device)
        return self._sdpa(q, keys, values, mask=self._mask(q_pos, k_pos))

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[n, L] bool: causal, and within the sliding window when there is one."""
        mask = k_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return mask

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [n, H, D], k/v [L, Hkv, D] -> [n, H, D]; causal when mask is None.

        KV heads are expanded and a batch dim added because SDPA's CPU flash kernel only takes
        4-D, non-GQA inputs; `enable_gqa` or 3-D inputs fall back to the math path (2-3x slower).
        """
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        if self.logits_soft_cap is not None:
            assert mask is not None
            return self._soft_capped(q4, k4, v4, mask)[0].transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=self.scale
        )
        return attn[0].transpose(0, 1)

    def _soft_capped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention with Gemma 2's tanh soft-capping of the scaled scores (SDPA cannot apply
        it): q [B, H, n, D], k/v [B, H or Hkv, L, D], mask broadcastable to [B, H, n, L] ->
        [B, H, n, D]. Softmax in float32, as HF's eager path."""
        group = self.num_heads // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        cap = self.logits_soft_cap
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
