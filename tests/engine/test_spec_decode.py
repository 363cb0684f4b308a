"""Speculative decoding (n-gram prompt lookup) on the real SmolLM2 in float32: greedy output is
the same token for token, with the same logprobs, as without speculation, whatever else is on
(prefix caching, chunked prefill, stop strings, max_tokens, logprobs, mixed batches,
preemption), drafts are accepted on prompts the answer copies, and every KV block comes back."""

from __future__ import annotations

import json

import pytest

from model_server.engine.llm import LLM
from model_server.engine.outputs import CompletionOutput
from model_server.sampling_params import SamplingParams
from tests.engine.test_invariants import assert_same_greedy

pytestmark = pytest.mark.slow

KV_CACHE = 64 * 1024**2
SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "disable_by_batch_size": 16,
    }
)
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly "
    "at the fox, who ran into the forest and hid behind an old oak tree. "
)
COPYING = [
    "Repeat this text exactly: " + PASSAGE * 2,
    "Rewrite the following passage, replacing 'fox' with 'cat' and changing nothing else:\n\n"
    + PASSAGE,
    "Here is a list: apples, pears, plums, apples, pears, plums, apples, pears. Continue it.",
]
NOT_COPYING = ["What is the capital of France?", "Write a haiku about the sea."]


def greedy(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2, **kw)


def samples(outputs) -> list[CompletionOutput]:
    return [o.outputs[0] for o in outputs]


def all_blocks_free(llm: LLM) -> bool:
    core = llm.engine.core
    return core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(kv_cache_memory=KV_CACHE, dtype="float32")


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(kv_cache_memory=KV_CACHE, dtype="float32", speculative_config=SPEC)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [plain.apply_chat_template([{"role": "user", "content": q}]) for q in COPYING]


@pytest.fixture(scope="module")
def other_prompts(plain: LLM) -> list[list[int]]:
    return [plain.apply_chat_template([{"role": "user", "content": q}]) for q in NOT_COPYING]


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts, other_prompts) -> list[CompletionOutput]:
    """Every prompt alone without speculation: copying ones first."""
    return [samples(plain.generate([p], greedy()))[0] for p in prompts + other_prompts]


def test_alone_identical_and_drafts_accepted(spec: LLM, prompts, other_prompts, reference):
    stats = spec.engine.core.scheduler.spec_decoding_stats
    got = [samples(spec.generate([p], greedy()))[0] for p in prompts + other_prompts]
    assert_same_greedy("float32", reference, got)
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text
    assert stats.num_drafts > 0
    # The copying prompts' answers are mostly copied: far fewer steps than tokens.
    assert stats.num_accepted_tokens > 0.4 * len(reference[0].token_ids)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert all_blocks_free(spec)


def test_batch_identical(spec: LLM, prompts, other_prompts, reference) -> None:
    got = samples(spec.generate(prompts + other_prompts, greedy()))
    assert_same_greedy("float32", reference, got)
    assert all_blocks_free(spec)


def test_prefix_cache_hits_and_repeats(spec: LLM, prompts, reference) -> None:
    kv = spec.engine.core.kv_cache_manager
    hits = kv.prefix_cache_hits
    for _ in range(2):
        got = samples(spec.generate(prompts[:1], greedy()))
        assert_same_greedy("float32", reference[:1], got)
    assert kv.prefix_cache_hits > hits
    assert all_blocks_free(spec)


def test_prompt_extended_by_a_previous_answer_hits_the_cache(spec: LLM, plain: LLM, prompts):
    # The previous answer's blocks were cached while speculating: a prompt that continues it
    # hits them, and any rejected draft in them would now change the output.
    first = samples(spec.generate(prompts[:1], greedy(40)))[0]
    follow = prompts[0] + first.token_ids + prompts[1][-8:]
    kv = spec.engine.core.kv_cache_manager
    hits = kv.prefix_cache_hits
    got = samples(spec.generate([follow], greedy(24)))
    assert kv.prefix_cache_hits - hits >= len(prompts[0])
    assert_same_greedy("float32", samples(plain.generate([follow], greedy(24))), got)


def test_chunked_prefill_small_budget(prompts, other_prompts, reference) -> None:
    llm = LLM(
        kv_cache_memory=KV_CACHE,
        dtype="float32",
        max_num_batched_tokens=16,
        speculative_config=SPEC,
    )
    got = samples(llm.generate(prompts + other_prompts, greedy()))
    assert_same_greedy("float32", reference, got)
    assert llm.engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert all_blocks_free(llm)


def test_max_tokens_never_exceeded(spec: LLM, prompts, reference) -> None:
    for n in (1, 2, 3, 5, 7):
        got = samples(spec.generate(prompts[:1], greedy(n)))[0]
        assert got.token_ids == reference[0].token_ids[:n]
        assert got.finish_reason == "length"
    assert all_blocks_free(spec)


def test_stop_strings_and_stop_tokens_inside_drafts(spec: LLM, plain: LLM, prompts) -> None:
    full = samples(plain.generate(prompts[:1], greedy()))[0]
    # Stop strings that appear well inside the copied passage (so inside accepted drafts).
    for stop in ("lazy", "oak tree", "barked"):
        assert stop in full.text
        params = SamplingParams(max_tokens=48, temperature=0.0, stop=[stop], logprobs=1)
        want = samples(plain.generate(prompts[:1], params))[0]
        got = samples(spec.generate(prompts[:1], params))[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        assert len(got.logprobs) == len(got.token_ids)
    stop_id = full.token_ids[20]
    params = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[stop_id])
    want = samples(plain.generate(prompts[:1], params))[0]
    got = samples(spec.generate(prompts[:1], params))[0]
    assert got.token_ids == want.token_ids and got.stop_reason == stop_id
    assert all_blocks_free(spec)


def test_streaming_deltas_add_up(spec: LLM, prompts, reference) -> None:
    from model_server.sampling_params import RequestOutputKind

    params = greedy()
    params.output_kind = RequestOutputKind.DELTA
    tokens: list[int] = []
    text = ""
    engine = spec.engine
    engine.add_request("stream", prompts[0], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids_delta
            text += out.outputs[0].text_delta
    assert tokens == reference[0].token_ids
    assert text == reference[0].text


def test_mixed_batch(spec: LLM, plain: LLM, prompts, other_prompts) -> None:
    # Greedy (speculating), seeded sampling, penalties, min_tokens and logit_bias in one batch.
    params = [
        greedy(),
        SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.0, min_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.0, logit_bias={13: 3.0}, ignore_eos=True),
    ]
    batch = [prompts[0], prompts[1], prompts[2], prompts[0], other_prompts[0]]
    stats = spec.engine.core.scheduler.spec_decoding_stats
    drafts = stats.num_drafts
    got = samples(spec.generate(batch, params))
    want = samples(plain.generate(batch, params))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i}"
        assert g.text == w.text
    assert stats.num_drafts > drafts
    assert all_blocks_free(spec)


def test_preemption(prompts, other_prompts, reference, plain: LLM) -> None:
    bytes_per_block = plain.engine.core.model_runner.bytes_per_block()
    small = LLM(
        kv_cache_memory=16 * bytes_per_block,
        dtype="float32",
        enable_prefix_caching=False,
        speculative_config=SPEC,
    )
    assert small.engine.core.num_blocks == 16
    batch = prompts + other_prompts
    got = samples(small.generate(batch, greedy(32)))
    want = [samples(plain.generate([p], greedy(32)))[0] for p in batch]
    assert_same_greedy("float32", want, got)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert small.engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert all_blocks_free(small)


def test_auto_policy_turns_speculation_off_for_wide_batches(prompts, reference) -> None:
    narrow = json.dumps({**json.loads(SPEC), "disable_by_batch_size": 2})
    llm = LLM(kv_cache_memory=KV_CACHE, dtype="float32", speculative_config=narrow)
    stats = llm.engine.core.scheduler.spec_decoding_stats
    got = samples(llm.generate(prompts, greedy()))  # 3 running: no drafts at all
    assert stats.num_drafts == 0
    assert_same_greedy("float32", reference[: len(prompts)], got)
    samples(llm.generate(prompts[:1], greedy()))
    assert stats.num_drafts > 0


def test_seeded_sampling_identical(spec: LLM, plain: LLM, prompts, other_prompts) -> None:
    # Each emitted token uses the draw it would have used without speculation: same seed, same
    # tokens, alone or batched, with drafts verified (and accepted) along the way.
    params = [
        SamplingParams(max_tokens=40, temperature=t, top_p=p, seed=s, ignore_eos=True, logprobs=1)
        for t, p, s in ((0.7, 1.0, 1), (1.0, 0.9, 2), (0.5, 0.95, 3))
    ]
    batch = prompts[:3]
    stats = spec.engine.core.scheduler.spec_decoding_stats
    drafts, accepted = stats.num_drafts, stats.num_accepted_tokens
    want = samples(plain.generate(batch, params))
    got_batch = samples(spec.generate(batch, params))
    got_alone = [samples(spec.generate([p], q))[0] for p, q in zip(batch, params, strict=True)]
    for i, w in enumerate(want):
        assert got_batch[i].token_ids == w.token_ids, f"request {i} batched"
        assert got_alone[i].token_ids == w.token_ids, f"request {i} alone"
        assert [lp.logprob for lp in got_alone[i].logprobs] == pytest.approx(
            [lp.logprob for lp in w.logprobs], abs=1e-3
        )
    assert stats.num_drafts > drafts and stats.num_accepted_tokens > accepted
    assert all_blocks_free(spec)


def test_unseeded_sampling_runs_and_frees(spec: LLM, prompts) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True, n=2)
    out = spec.generate(prompts[:2], params)
    assert all(len(o.token_ids) == 30 for r in out for o in r.outputs)
    assert all_blocks_free(spec)


def test_structured_outputs_beside_speculation(spec: LLM, plain: LLM, prompts) -> None:
    # A grammar-constrained request never speculates (its matcher would have to walk the
    # drafts); batched with speculating ones, it is the same as without speculation.
    from model_server.structured_output.params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    constrained = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    batch = [prompts[0], prompts[2], prompts[1]]
    params = [greedy(), constrained, greedy()]
    stats = spec.engine.core.scheduler.spec_decoding_stats
    drafts = stats.num_drafts
    got = samples(spec.generate(batch, params))
    want = samples(plain.generate(batch, params))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i}"
    json.loads(got[1].text)
    assert stats.num_drafts > drafts
    assert all_blocks_free(spec)


def test_bfloat16_equal_up_to_near_ties(prompts, other_prompts) -> None:
    # A multi-row verification step sums in another order than a one-row decode, as batching
    # and chunked prefill do: bf16 runs agree up to the reference's first near-tie.
    bf16 = {"kv_cache_memory": KV_CACHE, "dtype": "bfloat16"}
    plain16, spec16 = LLM(**bf16), LLM(**bf16, speculative_config=SPEC)
    batch = prompts + other_prompts
    want = [samples(plain16.generate([p], greedy(32)))[0] for p in batch]
    got = [samples(spec16.generate([p], greedy(32)))[0] for p in batch]
    assert_same_greedy("bfloat16", want, got)
    assert spec16.engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
