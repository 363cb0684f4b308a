"""The offline engine end to end on the real SmolLM2: sampling controls, n > 1, rejections."""

from __future__ import annotations

import pytest

from model_server.engine.core.request import RequestStatus
from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=64 * 1024**2, max_model_len=1024)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])


def test_max_tokens_gives_length(llm: LLM, prompt) -> None:
    out = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7
    assert out[0].outputs[0].finish_reason == "length"


def test_stop_string_cuts_text(llm: LLM, prompt) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0)
    full = llm.generate([prompt], greedy)[0].outputs[0].text
    words = full.split()
    stop = words[len(words) // 2]
    cut = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    o = cut[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full[: full.index(stop)]


def test_stop_token_ids(llm: LLM, prompt) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    target = tokens[5]
    first = tokens.index(target)
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target])
    o = llm.generate([prompt], params)[0].outputs[0]
    assert o.token_ids == tokens[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == target


def test_min_tokens_defers_eos(llm: LLM) -> None:
    short = llm.apply_chat_template([{"role": "user", "content": "Say only: yes"}])
    natural = llm.generate([short], SamplingParams(max_tokens=64, temperature=0))[0].outputs[0]
    assert natural.finish_reason == "stop"  # the model ends on its own
    n = len(natural.token_ids) + 5
    forced = llm.generate([short], SamplingParams(max_tokens=64, min_tokens=n, temperature=0))
    assert len(forced[0].outputs[0].token_ids) >= n


def test_seed_reproducible_alone_and_in_batch(llm: LLM, prompt) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=16, temperature=1.0)
    batch = llm.generate([prompt, prompt, prompt], [other, seeded, other])
    assert batch[1].outputs[0].token_ids == alone
    different = SamplingParams(max_tokens=16, temperature=1.0, seed=99)
    assert llm.generate([prompt], different)[0].outputs[0].token_ids != alone


def test_logprobs(llm: LLM, prompt) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    o = llm.generate([prompt], params)[0].outputs[0]
    assert len(o.logprobs) == 4
    for token, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_n2_samples_share_prompt_blocks(llm: LLM, prompt) -> None:
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7)
    engine.add_request("shared", prompt, params)
    children = [engine.core.scheduler.requests[c] for c in ("0_shared", "1_shared")]
    outputs = []
    while engine.has_unfinished_requests():
        if all(c.status == RequestStatus.RUNNING for c in children):
            full_blocks = (len(prompt) - 1) // engine.config.block_size
            assert full_blocks >= 1
            assert children[0].block_ids[:full_blocks] == children[1].block_ids[:full_blocks]
            assert children[1].num_cached_tokens >= full_blocks * engine.config.block_size
        outputs += [o for o in engine.step() if o.finished]
    samples = outputs[0].outputs
    assert len(samples) == 2 and all(len(s.token_ids) == 8 for s in samples)
    assert samples[0].token_ids != samples[1].token_ids  # seed + index: distinct samples


def test_num_cached_tokens_counts_prefix_cache_hits(llm: LLM) -> None:
    question = "A question seen by no other test: name three rivers of Peru, longest first."
    prompt = llm.apply_chat_template([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=2, temperature=0)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    full_blocks = (len(prompt) - 1) // llm.engine.config.block_size
    assert first.num_cached_tokens < full_blocks * llm.engine.config.block_size
    assert again.num_cached_tokens == full_blocks * llm.engine.config.block_size > 0


def test_rejections_are_clear(llm: LLM, prompt) -> None:
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        llm.generate([prompt * 40], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([prompt], SamplingParams(max_tokens=2000))
    with pytest.raises(ValueError, match="out of range for the vocabulary"):
        llm.generate([[1, 2, 10**9]], SamplingParams(max_tokens=4))
    # The engine keeps serving after a rejection.
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].finished


def test_request_bigger_than_whole_kv_cache_is_rejected(prompt) -> None:
    tiny = LLM(kv_cache_memory=4 * 46080 * 16, max_model_len=2048)  # 4 blocks of 16 tokens
    with pytest.raises(ValueError, match="KV cache"):
        tiny.generate([prompt], SamplingParams(max_tokens=200))


def test_the_token_budget_defaults_to_the_platforms(llm: LLM) -> None:
    from model_server.platforms.cpu import CpuPlatform

    # Unset, the CPU's smaller budget (a burst of prompts gets first tokens sooner); the scheduler
    # runs on the resolved value.
    core = llm.engine.core
    assert core.config.max_num_batched_tokens == CpuPlatform.default_max_num_batched_tokens == 512
    assert core.scheduler.config.max_num_batched_tokens == 512
    given = LLM(kv_cache_memory=16 * 1024**2, max_model_len=256, max_num_batched_tokens=96)
    assert given.engine.core.scheduler.config.max_num_batched_tokens == 96
