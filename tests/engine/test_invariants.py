"""Scheduling must never change what a greedy request generates (real SmolLM2 model)."""

from __future__ import annotations

import pytest

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=256 * 1024**2)


@pytest.fixture(scope="module")
def prompts(llm: LLM, chat_prompts) -> list[list[int]]:
    return [llm.apply_chat_template(c) for c in chat_prompts]


@pytest.fixture(scope="module")
def alone(llm: LLM, prompts) -> list[list[int]]:
    """Each prompt generated on its own: the reference for every invariant."""
    return [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]


def test_batch_of_16_equals_alone(llm: LLM, prompts, alone) -> None:
    assert len({len(p) for p in prompts}) > 8  # really mixed lengths
    assert token_ids(llm.generate(prompts, GREEDY)) == alone


def test_prefix_cache_on_equals_off(prompts, alone) -> None:
    system = {"role": "system", "content": "You are a concise assistant. " * 6}
    cached = LLM(kv_cache_memory=256 * 1024**2, enable_prefix_caching=True)
    uncached = LLM(kv_cache_memory=256 * 1024**2, enable_prefix_caching=False)
    convs = [
        [system, {"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a color.")
    ]
    shared = [cached.apply_chat_template(c) for c in convs]
    first = token_ids(cached.generate(shared[:1], GREEDY))
    kv = cached.engine.core.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    rest = token_ids(cached.generate(shared[1:], GREEDY))
    assert kv.prefix_cache_hits > hits_before  # the later requests reused the system prompt
    assert first + rest == token_ids(uncached.generate(shared, GREEDY))
    # A repeated prompt is served almost entirely from the cache and still matches.
    assert token_ids(cached.generate(prompts[3:4], GREEDY)) == alone[3:4]
    assert token_ids(cached.generate(prompts[3:4], GREEDY)) == alone[3:4]


def test_small_chunks_equal_whole_prefill(prompts, alone) -> None:
    chunked = LLM(
        kv_cache_memory=256 * 1024**2, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert token_ids(chunked.generate(prompts[:6], GREEDY)) == alone[:6]


def test_forced_preemption_equals_no_preemption(llm: LLM, prompts, alone) -> None:
    # 24 blocks of 16 tokens cannot hold 8 requests of ~40-70 tokens at once.
    bytes_per_block = llm.engine.core.model_runner.bytes_per_block()
    small = LLM(kv_cache_memory=24 * bytes_per_block, enable_prefix_caching=False)
    assert small.engine.core.num_blocks == 24
    assert token_ids(small.generate(prompts[:8], GREEDY)) == alone[:8]
    assert small.engine.core.scheduler.num_preemptions_total > 0
