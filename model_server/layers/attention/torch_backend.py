"""Portable paged attention in plain PyTorch: the reference every other backend is tested against.

Decodes are batched: their blocks are gathered into one padded [B, L, Hkv, D] context and masked
past each `seq_len`. Prefills run one request at a time with a causal mask offset by the number of
tokens already cached (chunked prefill, prefix-cache hits); a prefill with nothing cached attends
to its own fresh K/V without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata


def write_to_paged_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D] -> cache slots (k_cache, v_cache: [num_blocks, block_size, Hkv, D])."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_paged_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """[num_blocks_total, bs, Hkv, D] + [B, >=num_blocks] ids -> [B, num_blocks * bs, Hkv, D]."""
    # index_select over a 2-D view (one row per block) copies whole rows; on 4-D tensors and
    # with int32 indices torch takes much slower per-element paths on CPU.
    ids = block_tables[:, :num_blocks].reshape(-1).to(torch.int64)
    blocks = cache.view(cache.shape[0], -1).index_select(0, ids)  # [B * nb, bs * Hkv * D]
    return blocks.view(block_tables.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_to_paged_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, metadata)
        qsl = metadata.query_start_loc_cpu
        for i in range(nd, metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, metadata, i
            )
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        nd = q.shape[0]
        block_size = k_cache.shape[1]
        seq_lens = md.seq_lens_cpu[:nd]
        max_len = max(seq_lens)
        num_blocks = -(-max_len // block_size)
        tables = md.block_tables[:nd]
        keys = gather_paged_context(k_cache, tables, num_blocks).to(q.dtype)  # [nd, L, Hkv, D]
        values = gather_paged_context(v_cache, tables, num_blocks).to(q.dtype)
        length = keys.shape[1]
        positions = torch.arange(length, device=q.device)
        mask = positions[None, :] < md.seq_lens[:nd, None]  # [nd, L]
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
    ) -> torch.Tensor:
        query_len = q.shape[0]
        seq_len = md.seq_lens_cpu[i]
        if seq_len == query_len:
            # Nothing cached before this chunk: plain causal attention over the fresh K/V.
            return self._sdpa(q, k, v, mask=None)
        block_size = k_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        table = md.block_tables[i : i + 1]
        keys = gather_paged_context(k_cache, table, num_blocks)[0, :seq_len].to(q.dtype)
        values = gather_paged_context(v_cache, table, num_blocks)[0, :seq_len].to(q.dtype)
        # Query j sits at position seq_len - query_len + j and sees keys at positions <= it.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        return self._sdpa(q, keys, values, mask=k_pos[None, :] <= q_pos[:, None])

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
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return attn[0].transpose(0, 1)
