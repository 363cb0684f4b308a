"""KVCacheManager: exact block ids, ref counts, chained hashes, collision guard, LRU eviction."""

from __future__ import annotations

import pytest

from model_server.engine.core import kv_cache_manager as kvm
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.request import Request
from model_server.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=4))


def schedule_new(kv: KVCacheManager, req: Request, num_new: int | None = None) -> bool:
    """What the scheduler does for a waiting request: lookup, allocate, set computed tokens."""
    ids, num_computed = kv.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_computed
    ok = kv.allocate_slots(req, num_new, ids, num_computed)
    if ok:
        req.num_computed_tokens = num_computed
    return ok


def compute(kv: KVCacheManager, req: Request, num_new: int) -> None:
    """What update_from_output does after a step: advance and cache full blocks."""
    req.num_computed_tokens += num_new
    kv.cache_blocks(req, req.num_computed_tokens)


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.blocks]


def test_fresh_blocks_in_id_order_and_usage() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 10, [], 0)
    assert a.block_ids == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    assert refs(kv) == [1, 1, 1, 0, 0, 0, 0, 0]

    # Decode steps grow the table only when the last block is full.
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 1)
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1)
    assert a.block_ids == [0, 1, 2, 3]

    b = make_request("b", range(100, 105))
    assert schedule_new(kv, b)
    assert b.block_ids == [4, 5]
    kv.free(a)
    kv.free(b)
    assert a.block_ids == [] and b.block_ids == []
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    kv.free(a)  # idempotent
    assert kv.num_free_blocks == 8


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(8))
    assert schedule_new(kv, a)
    compute(kv, a, 8)
    kv.free(a)  # blocks 0, 1 now cached and free
    b = make_request("b", range(100, 112))
    assert schedule_new(kv, b)
    assert b.block_ids == [2, 3, 1]  # plain blocks first, then evict the LRU cached block
    c = make_request("c", [*range(8), 50, 51, 52, 53, 54])
    ids, num_computed = kv.get_computed_blocks(c)
    assert (ids, num_computed) == ([0], 4)
    before = (refs(kv), kv.num_free_blocks, kv.num_cached_blocks)
    # Needs block 0 (free, cached) + 3 fresh = 4 free blocks; only 1 is free.
    assert not kv.allocate_slots(c, c.num_tokens - 4, ids, num_computed)
    assert c.block_ids == []
    assert (refs(kv), kv.num_free_blocks, kv.num_cached_blocks) == before
    assert kv.prefix_cache_queries == 8 + 12  # the failed attempt is not counted
    assert kv.get_computed_blocks(c) == ([0], 4)  # block 0 still cached


def test_prefix_hit_shares_blocks_and_counts_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))
    assert schedule_new(kv, a)
    compute(kv, a, 10)
    assert kv.num_cached_blocks == 2  # blocks 0 and 1 are full; block 2 is not

    b = make_request("b", [*range(8), 77, 78])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert kv.get_computed_blocks(b) == ([0, 1], 8)  # lookups alone count nothing
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    assert schedule_new(kv, b)
    assert b.block_ids == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)

    kv.free(a)
    assert refs(kv)[:4] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.num_free_blocks == 8
    # A cached free block found again goes back to ref 1 and out of the free queue.
    c = make_request("c", [*range(4), 9, 9, 9])
    assert schedule_new(kv, c)
    assert c.block_ids[0] == 0 and refs(kv)[0] == 1
    assert kv.num_free_blocks == 6


def test_full_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))
    assert schedule_new(kv, a)
    compute(kv, a, 8)
    assert kv.num_cached_blocks == 2
    b = make_request("b", range(8))
    assert kv.get_computed_blocks(b) == ([0], 4)
    c = make_request("c", range(9))
    assert kv.get_computed_blocks(c) == ([0, 1], 8)


def test_hashes_chain_over_the_prefix() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 5, 6, 0])
    b = make_request("b", [3, 4, 5, 6, 0])
    assert schedule_new(kv, a)
    compute(kv, a, 5)
    assert len(a.block_hashes) == 2
    assert a.block_hashes[1] == kvm.hash_block_tokens(a.block_hashes[0], [5, 6])
    # Same content [5, 6] after a different prefix: a different hash, and no hit.
    assert kv.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes[1] != a.block_hashes[1]
    c = make_request("c", [1, 2, 5, 6, 7])
    assert kv.get_computed_blocks(c) == ([0, 1], 4)


def test_collision_guard_rejects_different_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: 42)
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 0])
    assert schedule_new(kv, a)
    compute(kv, a, 5)
    # Block 1 has the same hash as block 0 (a collision), so it is not registered.
    assert kv.num_cached_blocks == 1
    assert kv.blocks[0].block_hash == 42 and kv.blocks[1].block_hash is None
    assert kv.get_computed_blocks(make_request("b", [9, 9, 3, 4, 0])) == ([], 0)
    # Same first block: a hit; the second block's hash leads to block 0, whose tokens differ.
    assert kv.get_computed_blocks(make_request("c", [1, 2, 3, 4, 0])) == ([0], 2)
    # Even equal tokens are refused when the cached entry's parent is not the matched block.
    assert kv.get_computed_blocks(make_request("d", [1, 2, 1, 2, 0])) == ([0], 2)


def test_collision_guard_survives_parent_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    # First blocks all collide; later blocks chain normally. Q's K/V cached after P' must not be
    # served after P, even once P' is evicted and P takes over its hash.
    real = kvm.hash_block_tokens

    def first_blocks_collide(parent: int | None, tokens: list[int]) -> int:
        return 7 if parent is None else real(parent, tokens)

    monkeypatch.setattr(kvm, "hash_block_tokens", first_blocks_collide)
    kv = KVCacheManager(num_blocks=6, block_size=2)
    p_prime, p, q = [1, 1], [2, 2], [5, 5]
    r1 = make_request("r1", [*p_prime, 0])
    r2 = make_request("r2", [*p_prime, *q, 0])
    assert schedule_new(kv, r1) and schedule_new(kv, r2)  # both miss: computed concurrently
    assert (r1.block_ids, r2.block_ids) == ([0, 1], [2, 3, 4])
    compute(kv, r1, 3)
    compute(kv, r2, 5)
    # r2's P' is a duplicate of block 0 (stays plain); its Q chains onto block 0's entry.
    assert kv.blocks[2].block_hash is None and kv.blocks[3].block_hash is not None
    assert kv.get_computed_blocks(make_request("x", [*p_prime, *q, 0])) == ([0, 3], 4)
    kv.free(r1)
    kv.free(r2)
    # Take every plain block, then evict the LRU cached one: block 0 (P'), not block 3 (Q).
    filler = make_request("f", range(100, 109))
    assert schedule_new(kv, filler)
    assert filler.block_ids == [5, 1, 4, 2, 0]
    assert kv.blocks[3].block_hash is not None
    kv.free(filler)
    r3 = make_request("r3", [*p, *q, 0])
    assert kv.get_computed_blocks(r3) == ([], 0)
    assert schedule_new(kv, r3)
    compute(kv, r3, 5)
    assert kv.blocks[r3.block_ids[0]].block_hash == 7  # P now owns the colliding hash
    victim = make_request("v", [*p, *q, 9])
    # Block 3 (Q after P') has the right hash, tokens and parent hash, but the wrong parent entry.
    ids, _ = kv.get_computed_blocks(victim)
    assert 3 not in ids
    assert ids == [r3.block_ids[0]]


def test_eviction_is_lru_and_tail_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", range(7))  # 3 full blocks + 1 partial
    assert schedule_new(kv, a)
    compute(kv, a, 7)
    b = make_request("b", range(100, 105))  # 2 full blocks + 1 partial
    assert schedule_new(kv, b)
    compute(kv, b, 5)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2, 3], [4, 5, 6])
    kv.free(a)  # cached LRU: 2, 1, 0; plain: 7, 3
    kv.free(b)  # cached LRU: 2, 1, 0, 5, 4; plain: 7, 3, 6
    c = make_request("c", range(200, 214))  # needs 7 blocks
    assert schedule_new(kv, c)
    assert c.block_ids == [7, 3, 6, 2, 1, 0, 5]
    # a's head went with its tail; b's first block (freed last) is the only survivor.
    assert kv.get_computed_blocks(make_request("a2", range(7))) == ([], 0)
    assert kv.get_computed_blocks(make_request("b2", range(100, 105))) == ([4], 2)


def test_fork_shares_full_prompt_blocks_without_prefix_caching() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_request("p", range(10))
    assert schedule_new(kv, parent)
    compute(kv, parent, 10)
    assert kv.num_cached_blocks == 0
    child = make_request("p-1", range(10))
    with pytest.raises(ValueError, match="prompt is not computed"):
        kv.fork(make_request("q", range(10)), child)
    assert kv.fork(parent, child) == 8
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 8
    assert refs(kv)[:3] == [2, 2, 1]
    assert kv.allocate_slots(child, 2)
    assert child.block_ids == [0, 1, 3]
    kv.free(child)
    assert refs(kv)[:4] == [1, 1, 1, 0]

    # A prompt that fills its blocks exactly still leaves its last block to compute.
    parent8 = make_request("p8", range(50, 58))
    assert schedule_new(kv, parent8)
    compute(kv, parent8, 8)
    child8 = make_request("p8-1", range(50, 58))
    assert kv.fork(parent8, child8) == 4
    assert child8.block_ids == parent8.block_ids[:1]


def test_can_fit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.can_fit(16) and not kv.can_fit(17)
    a = make_request("a", range(9))
    assert schedule_new(kv, a)
    compute(kv, a, 9)
    assert kv.can_fit(16)  # blocks in use count: the cache's size is what bounds a request
    kv.free(a)
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 4


# ---- the sliding-window group (models whose layers attend within a window) ----


def test_sliding_group_frees_blocks_behind_the_window() -> None:
    """Window 8, blocks of 4: a query at position p needs keys (p - 8, p], so once the next
    query is at c, the blocks before (c - 7) // 4 are freed and their entries become null."""
    spec = kvm.SlidingWindowSpec(num_blocks=6, sliding_window=8)
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding=spec)
    req = make_request("a", range(10))
    assert schedule_new(kv, req)
    assert req.block_ids == [0, 1, 2] and req.sliding_block_ids == [1, 2, 3]
    compute(kv, req, 10)
    for token in range(10, 30):  # decode to 30 tokens
        req.append_output_token(token)
        assert kv.allocate_slots(req, 1)
        compute(kv, req, 1)
        held = [b for b in req.sliding_block_ids if b != kvm.NULL_BLOCK]
        # The window of the token just computed plus the block being filled.
        assert len(held) <= 8 // 4 + 1
        assert len(req.block_ids) == -(-req.num_computed_tokens // 4)
        assert len(req.sliding_block_ids) == len(req.block_ids)
    assert req.sliding_block_ids[:5] == [kvm.NULL_BLOCK] * 5
    # 30 tokens: 8 full blocks held, 3 sliding; the pool's other 2 usable blocks are free.
    assert kv.num_free_blocks == 16 - 8
    assert kv.num_free_sliding_blocks == 6 - 1 - 3
    kv.free(req)
    assert kv.num_free_blocks == 16 and kv.num_free_sliding_blocks == 5
    assert req.sliding_block_ids == []


def test_sliding_pool_exhaustion_refuses_without_changes() -> None:
    spec = kvm.SlidingWindowSpec(num_blocks=4, sliding_window=8)  # 3 usable blocks
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding=spec)
    a, b = make_request("a", range(8)), make_request("b", range(8))
    assert schedule_new(kv, a)
    assert not schedule_new(kv, b)  # needs 2 sliding blocks, 1 is free
    assert b.block_ids == [] and b.sliding_block_ids == []
    assert kv.num_free_blocks == 14 and kv.num_free_sliding_blocks == 1


def test_fork_shares_window_blocks_or_nothing() -> None:
    spec = kvm.SlidingWindowSpec(num_blocks=12, sliding_window=8)
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding=spec)
    parent = make_request("p", range(10))
    assert schedule_new(kv, parent)
    compute(kv, parent, 10)
    child = make_request("c", range(10))
    assert kv.fork(parent, child) == 8
    assert child.sliding_block_ids == parent.sliding_block_ids[:2]
    assert kv.allocate_slots(child, 2)
    kv.free(child)
    # The parent decodes on: its first blocks leave the window; a late child shares nothing.
    for token in range(10, 24):
        parent.append_output_token(token)
        assert kv.allocate_slots(parent, 1)
        compute(kv, parent, 1)
    late = make_request("l", range(10))
    assert kv.fork(parent, late) == 0 and late.sliding_block_ids == []
    kv.free(parent)
    assert kv.num_free_sliding_blocks == 11


def test_sliding_prefix_hit_needs_the_window_blocks_before_it() -> None:
    """A prefix hit is cut back to where the sliding blocks of the window before its end are
    still cached, and takes those blocks (not the ones behind the window) by reference."""
    spec = kvm.SlidingWindowSpec(num_blocks=10, sliding_window=8)
    kv = KVCacheManager(num_blocks=32, block_size=4, sliding=spec)
    a = make_request("a", range(21))
    assert schedule_new(kv, a)
    compute(kv, a, 21)  # 5 full blocks registered in both pools
    sliding_a = list(a.sliding_block_ids)
    kv.free(a)
    b = make_request("b", [*range(20), 99, 98])
    assert schedule_new(kv, b)
    # 20 tokens hit; the query at 20 needs positions 13..19: sliding blocks 3 and 4 only.
    assert b.num_computed_tokens == 20
    assert b.sliding_block_ids[:3] == [kvm.NULL_BLOCK] * 3
    assert b.sliding_block_ids[3:5] == sliding_a[3:5]
    assert len(b.sliding_block_ids) == 6
    kv.free(b)
    # Evict the cached sliding blocks: a third request with the same prefix gets no hit.
    filler = make_request("f", range(100, 136))  # 9 sliding blocks: the whole usable pool
    assert schedule_new(kv, filler)
    kv.free(filler)
    c = make_request("c", [*range(20), 7])
    assert schedule_new(kv, c)
    assert c.num_computed_tokens == 0
