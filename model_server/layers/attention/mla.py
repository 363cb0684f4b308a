"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

The cache keeps, per token, what the paper promises: the normalised KV latent c (kv_lora_rank
values) and the rotated shared rope key k_pe (qk_rope_head_dim values), never per-head K/V.
One tensor per layer, [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; token p of a
request lives at the same slot as in the K/V layout (`slot_mapping`, `block_tables`).

kv_b_proj's weight W [H * (Dn + Dv), L] expands a latent into head h's k_nope (rows Dn) and
value (rows Dv):
  - Prefills (whole prompts, chunks after cached tokens) expand the latents of their context
    (read back from the cache when some were cached) and run causal SDPA over
    K = [k_nope, k_pe], V: the reference's own arithmetic.
  - Decodes absorb W into the query instead: q_lat[h] = q_nope[h] W_uk[h] (L values), so the
    scores are [q_lat, q_pe] . [c, k_pe] over the cached rows as they are, the output is the
    probability-weighted latent, and W_uv[h] maps it to head h's value: no per-token expansion
    of the context, the cache read once for all heads.

The arithmetic is PyTorch's, so it runs on every device and is what the `torch` attention
backend gets for MLA models. With the `cpu` backend (`decode_kernel="cpu"`) every step runs the
native kernel kernels/cpu/mla_attention.c instead (store, then absorbed attention for decodes
and prefill rows alike: exact for both, the same value as the expanded path up to rounding),
the very call the native decoder step makes, so the two agree bit for bit; inputs it does not
take (a cache of another dtype) run the PyTorch path after one warning. With the
`triton` backend (`decode_kernel="triton"`) the latents are stored by the Triton KV store (slots
< 0 skipped: CUDA-graph padding) and decodes read the latent cache in place with
kernels/mla_decode.py (no gather of the context into a padded copy), which only reads device
tensors, so a captured decode graph replays; prefills keep the expanded PyTorch path above (SDPA
runs its flash kernels on CUDA; prefills are never captured).
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from model_server.kernels.cpu import mla_attention as native_mla
from model_server.kernels.cpu import native
from model_server.layers.attention.backend import AttentionMetadata
from model_server.layers.attention.torch_backend import gather_paged_context

logger = logging.getLogger(__name__)


@cache
def _warn_fallback(reason: str) -> None:
    """Once per process and reason: every layer and step would repeat it."""
    logger.warning(
        "native CPU MLA attention (kernels/cpu/mla_attention.c) is not used: %s; MLA runs on "
        "the PyTorch path",
        reason,
    )


class MLAAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        decode_kernel: str = "torch",
    ) -> None:
        super().__init__()
        if decode_kernel not in ("torch", "triton", "cpu"):
            raise ValueError(f"MLA decode kernel {decode_kernel!r}: choose torch, triton or cpu")
        self.decode_kernel = decode_kernel
        # "cpu": the native kernel (built once per process and ISA, then cached), or None.
        self.kernels = native.load_kernels() if decode_kernel == "cpu" else None
        self.num_heads = num_heads  # this rank's
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale

    @property
    def cache_entry_size(self) -> int:
        """Values cached per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        w_kv_b: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, R] (rotated), latent [T, L] (normalised), k_pe [T, R]
        (rotated), w_kv_b [H * (Dn + Dv), L], kv_cache [blocks, block_size, L + R]
        -> [T, H * Dv]. Writes this step's latents into the cache first."""
        if self.decode_kernel == "cpu":
            reason = "the kernels could not be built" if self.kernels is None else None
            reason = reason or native_mla.unsupported_reason(q_nope, kv_cache)
            if reason is None:
                assert self.kernels is not None
                return native_mla.mla_attention(
                    self.kernels, q_nope, q_pe, latent, k_pe, w_kv_b, kv_cache,
                    md.slot_mapping, md.block_tables, md.query_start_loc, md.seq_lens,
                    self.scale, self.v_head_dim,
                )  # fmt: skip
            _warn_fallback(reason)
        entries = torch.cat((latent, k_pe), dim=-1)  # [T, L + R]
        if self.decode_kernel == "triton":
            from model_server.kernels.store_kv import store_kv_cache

            # One "KV head" of L + R values; key and value are the same row, written twice.
            rows, cache = entries[:, None], kv_cache.unsqueeze(2)
            store_kv_cache(rows, rows, cache, cache, md.slot_mapping)
        else:
            kv_cache.view(-1, self.cache_entry_size).index_copy_(
                0, md.slot_mapping, entries.to(kv_cache.dtype)
            )
        num_tokens = q_nope.shape[0]
        out = q_nope.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        w = w_kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        nd = md.num_decodes
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, md, w)
        qsl = md.query_start_loc_cpu
        for i in range(nd, md.num_reqs):
            s, e = qsl[i], qsl[i + 1]
            out[s:e] = self._prefill(q_nope[s:e], q_pe[s:e], entries[s:e], kv_cache, md, i, w_kv_b)
        return out.view(num_tokens, self.num_heads * self.v_head_dim)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        w: torch.Tensor,
    ) -> torch.Tensor:
        """Absorbed: [nd, H, Dn] + [nd, H, R] -> [nd, H, Dv]."""
        nd, lora = q_nope.shape[0], self.kv_lora_rank
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]  # [H, Dn|Dv, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [nd, H, L]
        query = torch.cat((q_lat, q_pe), dim=-1)  # [nd, H, L + R]
        if self.decode_kernel == "triton":
            from model_server.kernels.mla_decode import mla_decode_attention

            o_lat = mla_decode_attention(
                query, kv_cache, md.seq_lens[:nd], md.block_tables[:nd], lora, self.scale
            ).to(q_nope.dtype)  # [nd, H, L]
            return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        block_size = kv_cache.shape[1]
        num_blocks = -(-max(md.seq_lens_cpu[:nd]) // block_size)
        ctx = gather_paged_context(kv_cache, md.block_tables[:nd], num_blocks).to(q_nope.dtype)
        scores = torch.bmm(query, ctx.transpose(1, 2)) * self.scale  # [nd, H, S]
        positions = torch.arange(ctx.shape[1], device=ctx.device)
        valid = positions[None, :] < md.seq_lens[:nd, None]  # [nd, S]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        o_lat = torch.bmm(probs, ctx[..., :lora])  # [nd, H, L]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        fresh: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        i: int,
        w_kv_b: torch.Tensor,
    ) -> torch.Tensor:
        """Expanded: one request's [n, H, Dn] + [n, H, R] -> [n, H, Dv]."""
        query_len, seq_len = q_nope.shape[0], md.seq_lens_cpu[i]
        if seq_len == query_len:
            ctx, mask = fresh, None  # nothing cached before this chunk
        else:
            block_size = kv_cache.shape[1]
            num_blocks = -(-seq_len // block_size)
            table = md.block_tables[i : i + 1]
            ctx = gather_paged_context(kv_cache, table, num_blocks)[0, :seq_len].to(q_nope.dtype)
            q_pos = torch.arange(seq_len - query_len, seq_len, device=ctx.device)
            mask = torch.arange(seq_len, device=ctx.device)[None, :] <= q_pos[:, None]
        latent, k_pe = ctx.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, w_kv_b).view(ctx.shape[0], self.num_heads, -1)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        attn = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # [1, H, n, Dn + R]
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),  # [1, H, S, Dv]
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return attn[0].transpose(0, 1)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope={self.qk_rope_head_dim}, nope={self.qk_nope_head_dim}, v={self.v_head_dim}, "
            f"decode={self.decode_kernel}"
        )
