"""Scheduling must never change what a greedy request generates (real SmolLM2 model).

Each invariant (batched == alone, prefix cache on == off, small chunks == whole prefill,
preempted == not) runs in both dtypes, pinned so that no result depends on what `auto` picks on
this CPU:
- float32: the tokens are equal, exactly;
- bfloat16: sums depend on the batch's shape, so logits differ by a few bf16 steps. Tokens must
  be equal up to the first near-tie of the reference (top-2 logprobs closer than TIE_MARGIN,
  where the other run may pick the runner-up), and their logprobs equal within LOGPROB_TOL.
"""

from __future__ import annotations

import pytest

from model_server.engine.llm import LLM
from model_server.engine.outputs import CompletionOutput
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

KV_CACHE = 256 * 1024**2
# bf16 logits near 20 are spaced 0.125 apart; measured on SmolLM2 (16 prompts, 24 tokens):
# batched vs alone moved a logprob by at most 0.09, 16-token chunks by 0.20, and runs diverged
# only where the reference's top two were within 0.25.
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 0.3}
TIE_MARGIN = {"float32": 0.0, "bfloat16": 0.5}
# bf16 is emulated (several times slower) on CPUs without native bf16: a smaller workload.
NUM_PROMPTS = {"float32": 16, "bfloat16": 8}
# Share of all tokens compared before each prompt's first near-tie flip. The embedded model's
# chat answers often open on a near-tie (the France question's first token: 0.08 nats in fp32),
# and a flip there ends that prompt's comparison: with the per-machine tuned matmuls (another
# kernel per row count) bf16 runs agreed on 69-71% of the tokens on a Zen 4, every flip at a
# near-tie.
MIN_AGREEING = {"float32": 0.75, "bfloat16": 0.5}
MAX_TOKENS = {"float32": 24, "bfloat16": 16}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    return request.param


def greedy(dtype: str) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS[dtype], temperature=0.0, ignore_eos=True, logprobs=2
    )


def samples(outputs) -> list[CompletionOutput]:
    return [o.outputs[0] for o in outputs]


def assert_same_greedy(dtype: str, expected: list[CompletionOutput], got: list[CompletionOutput]):
    """`got` generated what `expected` did: exactly in fp32; in bf16 up to the first near-tie."""
    assert len(got) == len(expected)
    compared = total = 0
    for i, (ref, out) in enumerate(zip(expected, got, strict=True)):
        assert ref.logprobs is not None and out.logprobs is not None
        total += len(ref.token_ids)
        if dtype == "float32":
            assert out.token_ids == ref.token_ids, f"prompt {i}"
        for pos, (a, b) in enumerate(zip(ref.logprobs, out.logprobs, strict=True)):
            if a.token_id != b.token_id:
                top1, top2 = a.top[0][1], a.top[1][1]
                assert top1 - top2 <= TIE_MARGIN[dtype], (
                    f"prompt {i} token {pos}: {b.token_id} instead of {a.token_id}, whose lead "
                    f"of {top1 - top2:.3f} is no near-tie"
                )
                assert b.token_id in (t for t, _ in a.top), f"prompt {i} token {pos}"
                break  # past a tie the two runs continue different texts
            assert b.logprob == pytest.approx(a.logprob, abs=LOGPROB_TOL[dtype]), (
                f"prompt {i} token {pos}"
            )
            compared += 1
    # An invariant that holds only for the first token or two is broken.
    assert compared >= MIN_AGREEING[dtype] * total, f"only {compared} of {total} tokens agree"


@pytest.fixture(scope="module")
def llm(dtype: str) -> LLM:
    return LLM(kv_cache_memory=KV_CACHE, dtype=dtype)


@pytest.fixture(scope="module")
def prompts(llm: LLM, dtype: str, chat_prompts) -> list[list[int]]:
    return [llm.apply_chat_template(c) for c in chat_prompts[: NUM_PROMPTS[dtype]]]


@pytest.fixture(scope="module")
def alone(llm: LLM, dtype: str, prompts) -> list[CompletionOutput]:
    """Each prompt generated on its own: the reference for every invariant."""
    return [samples(llm.generate([p], greedy(dtype)))[0] for p in prompts]


def test_the_engine_runs_in_the_pinned_dtype(llm: LLM, dtype: str) -> None:
    assert str(llm.engine.core.model_runner.dtype) == f"torch.{dtype}"


def test_batch_equals_alone(llm: LLM, dtype: str, prompts, alone) -> None:
    assert len({len(p) for p in prompts}) > len(prompts) // 2  # really mixed lengths
    assert_same_greedy(dtype, alone, samples(llm.generate(prompts, greedy(dtype))))


def test_prefix_cache_on_equals_off(dtype: str, prompts, alone) -> None:
    system = {"role": "system", "content": "You are a concise assistant. " * 6}
    cached = LLM(kv_cache_memory=KV_CACHE, dtype=dtype, enable_prefix_caching=True)
    uncached = LLM(kv_cache_memory=KV_CACHE, dtype=dtype, enable_prefix_caching=False)
    convs = [
        [system, {"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a color.")
    ]
    shared = [cached.apply_chat_template(c) for c in convs]
    first = samples(cached.generate(shared[:1], greedy(dtype)))
    kv = cached.engine.core.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    rest = samples(cached.generate(shared[1:], greedy(dtype)))
    assert kv.prefix_cache_hits > hits_before  # the later requests reused the system prompt
    assert_same_greedy(dtype, samples(uncached.generate(shared, greedy(dtype))), first + rest)
    # A repeated prompt is served almost entirely from the cache and still matches.
    for _ in range(2):
        assert_same_greedy(dtype, alone[3:4], samples(cached.generate(prompts[3:4], greedy(dtype))))


def test_small_chunks_equal_whole_prefill(dtype: str, prompts, alone) -> None:
    chunked = LLM(
        kv_cache_memory=KV_CACHE,
        dtype=dtype,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert_same_greedy(dtype, alone[:6], samples(chunked.generate(prompts[:6], greedy(dtype))))


def test_forced_preemption_equals_no_preemption(llm: LLM, dtype: str, prompts, alone) -> None:
    # 24 blocks of 16 tokens cannot hold 8 requests of ~40-70 tokens at once.
    bytes_per_block = llm.engine.core.model_runner.bytes_per_block()
    small = LLM(kv_cache_memory=24 * bytes_per_block, dtype=dtype, enable_prefix_caching=False)
    assert small.engine.core.num_blocks == 24
    assert_same_greedy(dtype, alone[:8], samples(small.generate(prompts[:8], greedy(dtype))))
    assert small.engine.core.scheduler.num_preemptions_total > 0
