"""paged_decode_attention vs the per-request reference: GQA groups, block sizes, split-K."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.paged_decode import choose_num_splits, paged_decode_attention
from model_server.kernels.reference import paged_attention_reference
from model_server.kernels.store_kv import store_kv_cache
from tests.kernels.helpers import make_batch, tolerance

pytestmark = pytest.mark.kernels

# Context lengths (after this step) cross block and tile boundaries: 1 token, one past a block of
# 8/16, and long enough for several 16-token tiles and splits.
DECODES = [(0, 1), (16, 1), (44, 1)]


def _check(
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    num_splits,
    device,
    dtype=torch.float32,
    tile_n=16,
    requests=DECODES,
):
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        fill=float("nan"),  # any read of a masked slot poisons the output
    )
    md = b.metadata
    assert md.num_decodes == len(requests)
    store_kv_cache(b.k, b.v, b.k_cache, b.v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    out = torch.full_like(b.q, float("nan"))
    paged_decode_attention(
        out,
        b.q,
        b.k_cache,
        b.v_cache,
        md.seq_lens,
        md.block_tables,
        scale,
        md.max_seq_len,
        num_splits,
        tile_n=tile_n,
    )
    ref = paged_attention_reference(
        b.q, b.k_cache, b.v_cache, md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, scale
    )
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(
    head_dim, num_heads, num_kv_heads, block_size, num_splits, device
):
    _check(num_heads, num_kv_heads, head_dim, block_size, num_splits, device)


def test_decode_default_tile_and_many_splits(device):
    # tile_n 64 (the GPU default) and more splits than some requests have tiles.
    _check(8, 2, 64, 16, 8, device, tile_n=64, requests=[(3, 1), (200, 1), (64, 1)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype, device):
    _check(8, 2, 64, 16, 2, device, dtype=dtype)


def test_decode_large_group(device):
    # 16 query heads per KV head: BLOCK_H is the group itself.
    _check(32, 2, 64, 8, 2, device)


def test_choose_num_splits():
    # Plenty of (seq, kv head) programs: no split.
    assert choose_num_splits(64, 8, 4096, target_programs=528) == 1
    # One long request: split up to the cap.
    assert choose_num_splits(1, 8, 8192, target_programs=528, max_splits=16) == 16
    # Short context: never below min_split_tokens per split.
    assert choose_num_splits(1, 8, 300, min_split_tokens=256, target_programs=528) == 2


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_graph_batch_padding_and_length_bound(num_splits, device):
    """A CUDA-graph batch: real rows, then padding rows of length 0, launched with an upper
    bound (max_model_len) instead of the real max length. Real rows match the reference;
    padding rows read nothing (the cache is NaN-filled) and come out as zeros."""
    requests = [(0, 1), (37, 1), (130, 1)]
    b = make_batch(
        requests,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        device=device,
        fill=float("nan"),
    )
    md = b.metadata
    store_kv_cache(b.k, b.v, b.k_cache, b.v_cache, md.slot_mapping)
    pad = 2
    q = torch.cat([b.q, torch.randn(pad, 8, 64, device=device)])
    seq_lens = torch.cat([md.seq_lens, torch.zeros(pad, dtype=torch.int32, device=device)])
    width = 4096 // 16
    tables = torch.zeros((len(requests) + pad, width), dtype=torch.int32, device=device)
    tables[: len(requests), : md.block_tables.shape[1]] = md.block_tables
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        out, q, b.k_cache, b.v_cache, seq_lens, tables, 0.125, 4096, num_splits, tile_n=16
    )
    ref = paged_attention_reference(
        b.q, b.k_cache, b.v_cache, md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, 0.125
    )
    torch.testing.assert_close(out[: len(requests)], ref, **tolerance(torch.float32))
    assert torch.equal(out[len(requests) :], torch.zeros_like(out[len(requests) :]))
