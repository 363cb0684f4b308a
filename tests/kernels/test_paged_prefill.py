"""paged_prefill_attention vs the per-request reference: cached prefixes, chunks, GQA packing."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.paged_prefill import paged_prefill_attention
from model_server.kernels.reference import paged_attention_reference
from model_server.kernels.store_kv import store_kv_cache
from tests.kernels.helpers import make_batch, tolerance

pytestmark = pytest.mark.kernels

# (num_cached, num_new): a decode first (the kernel must skip it), a whole prompt, a chunk after a
# prefix crossing block boundaries, a prefix-cache hit of exactly one block, a 2-token tail.
REQUESTS = [(20, 1), (0, 13), (9, 30), (16, 5), (3, 2)]


def _check(
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    device,
    dtype=torch.float32,
    block_m=16,
    tile_n=16,
    requests=REQUESTS,
):
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        fill=float("nan"),
    )
    md = b.metadata
    store_kv_cache(b.k, b.v, b.k_cache, b.v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    out = torch.zeros_like(b.q)
    paged_prefill_attention(
        out,
        b.q,
        b.k_cache,
        b.v_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_tables,
        scale,
        md.num_decodes,
        md.num_prefills,
        md.max_query_len,
        block_m=block_m,
        tile_n=tile_n,
    )
    prefills = range(md.num_decodes, md.num_reqs)
    ref = paged_attention_reference(
        b.q,
        b.k_cache,
        b.v_cache,
        md.query_start_loc_cpu,
        md.seq_lens_cpu,
        b.block_tables,
        scale,
        prefills,
    )
    # Decode rows are untouched (zeros in both).
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_matches_reference(head_dim, num_heads, num_kv_heads, block_size, device):
    # block_m 16: 16/8/4/5 query tokens per program, so chunks span several query tiles.
    _check(num_heads, num_kv_heads, head_dim, block_size, device)


def test_prefill_default_blocks(device):
    # The defaults (block_m 64, tile_n 64) with chunks long enough for full, unmasked tiles.
    _check(8, 2, 64, 16, device, block_m=None, tile_n=None, requests=[(70, 40), (0, 90)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(dtype, device):
    _check(8, 2, 64, 16, device, dtype=dtype, block_m=32)


def test_prefill_large_group(device):
    # 16 query heads per KV head: one query token per 16-row program.
    _check(32, 2, 64, 8, device, requests=[(5, 6), (0, 3)])
