"""KV cache events: vLLM's block hashes (checked against cbor2, an independent CBOR encoder),
and the events the KV cache manager's registrations and evictions turn into."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from model_server.engine.core import kv_events as ke
from model_server.engine.core.kv_cache_manager import KVCacheManager
from tests.engine.core.test_kv_cache_manager import compute, make_request, schedule_new


def reference_hash(parent: bytes, tokens: list[int]) -> bytes:
    """vLLM's sha256_cbor block hash, with cbor2's canonical encoder."""
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), None), canonical=True)).digest()


def reference_chain(tokens: list[int], block_size: int) -> list[int]:
    """The external hashes of every full block of `tokens`."""
    parent = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    hashes = []
    for i in range(len(tokens) // block_size):
        parent = reference_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(int.from_bytes(parent[-8:], "big"))
    return hashes


@pytest.mark.parametrize(
    "value",
    [None, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -25, "", "vllm-none-hash",
     b"\x00" * 32, (1, (2, 3), None), list(range(300)), True, False],
)  # fmt: skip
def test_cbor_matches_cbor2_canonical(value: object) -> None:
    assert ke.cbor_encode(value) == cbor2.dumps(value, canonical=True)


def test_block_hashes_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(1000, 1040))
    recorder = ke.KVEventRecorder(block_size=16)
    recorder.block_stored(0, None, tokens, 0)
    recorder.block_stored(1, 0, tokens, 1)
    events = recorder.take_events()
    # The first batch says the cache starts empty; the two blocks of one prefix are one event.
    assert isinstance(events[0], ke.AllBlocksCleared)
    assert events[1:] == [
        ke.BlockStored(reference_chain(tokens, 16), None, tokens[:32], 16, None, "GPU", None)
    ]
    # PYTHONHASHSEED seeds NONE_HASH, as in vLLM.
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seeded = ke.KVEventRecorder(block_size=16)
    seeded.block_stored(0, None, tokens, 0)
    seeded_hash = seeded.take_events()[1].block_hashes[0]
    seed = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    expected = reference_hash(seed, tokens[:16])
    assert seeded_hash == int.from_bytes(expected[-8:], "big")


def test_a_child_of_an_evicted_parent_still_chains_on_the_prefix() -> None:
    tokens = list(range(48))
    recorder = ke.KVEventRecorder(block_size=16)
    recorder.block_stored(7, None, tokens, 0)
    recorder.block_stored(8, 7, tokens, 1)
    recorder.block_removed(8)
    recorder.block_removed(7)
    recorder.block_stored(9, 8, tokens, 2)  # parent entry 8 is gone: hashed from the tokens
    events = recorder.take_events()[1:]
    chain = reference_chain(tokens, 16)
    assert events == [
        ke.BlockStored(chain[:2], None, tokens[:32], 16),
        ke.BlockRemoved([chain[1], chain[0]]),
        ke.BlockStored([chain[2]], chain[1], tokens[32:48], 16),
    ]
    assert recorder.cached_hashes() == {chain[2]}


def test_the_manager_reports_what_it_caches_and_evicts() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.kv_events = ke.KVEventRecorder(block_size=4)
    kv.kv_events.take_events()
    a = make_request("a", list(range(100, 112)))  # 3 full blocks
    assert schedule_new(kv, a)
    compute(kv, a, 12)
    b = make_request("b", [*range(100, 108), 7, 7, 7, 7, 9])  # shares 2 blocks of a
    assert schedule_new(kv, b)
    compute(kv, b, b.num_tokens - b.num_computed_tokens)
    chain_a = reference_chain(a.all_token_ids, 4)
    chain_b = reference_chain(b.all_token_ids, 4)
    assert kv.kv_events.take_events() == [
        ke.BlockStored(chain_a, None, a.all_token_ids[:12], 4),
        ke.BlockStored([chain_b[2]], chain_b[1], [7, 7, 7, 7], 4),
    ]
    kv.free(a)
    kv.free(b)
    # 6 blocks: a's 3, b's own 2 (one full, one partial); a request of 6 blocks evicts every
    # cached one, least recently freed first: a's last block (a frees first), then b's blocks
    # tail first (its full one, then the two it shares with a).
    c = make_request("c", list(range(500, 524)))
    assert schedule_new(kv, c)
    removed = kv.kv_events.take_events()
    assert removed == [ke.BlockRemoved([chain_a[2], chain_b[2], chain_a[1], chain_a[0]])]
    assert kv.kv_events.cached_hashes() == set()
    compute(kv, c, 24)
    assert kv.kv_events.cached_hashes() == set(reference_chain(c.all_token_ids, 4))
    assert kv.num_cached_blocks == len(kv.kv_events.cached_hashes())
