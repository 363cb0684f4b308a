"""KV cache events from the real engine (SmolLM2) over ZeroMQ: a subscriber that knows only the
wire (tests/engine/kv_event_subscriber.py) rebuilds the set of cached block hashes after a mixed
workload with evictions, and it is the engine's own; a subscriber that joins late gets the
missed batches from the replay endpoint; the hashes are vLLM's over the tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from model_server.config import EngineConfig, KVEventsConfig
from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams
from tests.engine.core.test_kv_events import reference_chain
from tests.engine.kv_event_subscriber import KVEventSubscriber
from tests.loopback import free_port

pytestmark = pytest.mark.slow

BLOCK = 16


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def llm(ports: tuple[int, int]) -> Iterator[LLM]:
    pub, replay = ports
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    # A small cache (a few dozen blocks), so that the workload below evicts.
    llm = LLM(
        kv_cache_memory=24 * 1024**2,
        max_model_len=256,
        dtype="float32",
        kv_events_config=json.dumps(events),
    )
    try:
        yield llm
    finally:
        llm.shutdown()


def test_a_subscriber_rebuilds_the_engines_cached_blocks(llm: LLM, ports: tuple[int, int]) -> None:
    pub, replay = ports
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv")
    core = llm.engine.core
    manager = core.kv_cache_manager
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        shared = list(range(1000, 1000 + 4 * BLOCK))  # 4 blocks every request below starts with
        prompts = [shared + [2000 + i] * (BLOCK + 3) for i in range(4)]  # shared prefix, batched
        prompts += [[3000 + 7 * i + j for j in range(3 * BLOCK + 5)] for i in range(3)]
        llm.generate(prompts, greedy)
        # Sequentially, unrelated prompts: more blocks than the cache has, so entries go.
        for i in range(manager.num_blocks // 4 + 2):
            llm.generate([[5000 + 11 * i + j for j in range(4 * BLOCK + 1)]], greedy)
        llm.generate([shared + [9] * BLOCK], greedy)  # the shared prefix again, after evictions
        # The subscriber joined after the engine started (a slow joiner misses batch 0 at
        # least): the gap comes from the replay endpoint.
        sub.drain()
        assert sub.batches[0]["events"] == [{"type": "AllBlocksCleared"}]
        assert sub.events("BlockRemoved"), "the workload evicted nothing"

        # The engine's own view: every prefix-cache entry of the manager.
        assert sub.cached == manager.kv_events.cached_hashes()
        assert len(sub.cached) == manager.num_cached_blocks

        # Independently of the recorder: the vLLM hash of each cached block whose whole chain
        # is still cached, from its tokens.
        entries = {b.cache_id: b for b in manager._hash_to_block.values()}
        checked = 0
        for block in entries.values():
            chain, cur = [], block
            while cur is not None:
                chain.append(cur)
                cur = entries.get(cur.parent_cache_id) if cur.parent_cache_id is not None else None
            if chain[-1].parent_cache_id is not None:
                continue  # an ancestor was evicted: its tokens are gone from the manager
            tokens = [t for b in reversed(chain) for t in b.token_ids]
            assert reference_chain(tokens, BLOCK)[-1] in sub.cached
            checked += 1
        assert checked >= 4
        # The shared prefix's 4 blocks are cached, as the hashes of its tokens.
        assert set(reference_chain(shared, BLOCK)) <= sub.cached

        # Each BlockStored carries its tokens and chains onto its parent, as a router needs.
        for event in sub.events("BlockStored"):
            assert event["block_size"] == BLOCK
            assert len(event["token_ids"]) == BLOCK * len(event["block_hashes"])
            assert event["medium"] == "GPU" and event["lora_id"] is None
    finally:
        sub.close()


def test_the_config_is_vllms_and_refuses_what_wick_does_not_do() -> None:
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config == KVEventsConfig("tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    for bad, message in [
        ('{"enable_kv_cache_events": true, "publisher": "nats"}', "publisher 'nats'"),
        ('{"enable_kv_cache_events": true, "endpoints": "x"}', "unknown field"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be a positive"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.parse(bad)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(
            kv_events_config='{"enable_kv_cache_events": true}', enable_prefix_caching=False
        ).validate()
