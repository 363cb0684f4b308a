"""Speculative decoding with a draft model (`--speculative-config '{"model": ...}'`) on the real
SmolLM2 in float32: output token for token as without speculation (greedy and seeded sampling,
stop strings, logprobs, max_tokens inside a draft run, prefix-cache hits, chunked prefill,
preemption), with a tiny random draft (drafts mostly rejected: back-off gaps and catch-ups) and
with SmolLM2 drafting for itself (drafts accepted: the draft really drafts); the draft's cache
takes its share of the KV budget; what cannot be honoured is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from model_server.config import EngineConfig, SpeculativeConfig
from model_server.engine.llm import LLM
from model_server.loader.embedded import EMBEDDED_VOCAB_SIZE, embedded_model_path
from model_server.sampling_params import SamplingParams
from tests.engine.test_invariants import assert_same_greedy
from tests.engine.test_spec_decode import (
    COPYING,
    KV_CACHE,
    NOT_COPYING,
    all_blocks_free,
    greedy,
    samples,
)

pytestmark = pytest.mark.slow


def save_tiny_llama(folder: Path, vocab_size: int, seed: int = 0) -> str:
    """A random 2-layer Llama (float32 safetensors, no tokenizer) in `folder`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=8192,  # SmolLM2's context: a draft may not be shorter
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def draft_config(model: str, k: int = 4) -> str:
    return json.dumps({"model": model, "num_speculative_tokens": k, "disable_by_batch_size": 16})


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("draft"), EMBEDDED_VOCAB_SIZE)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(kv_cache_memory=KV_CACHE, dtype="float32")


@pytest.fixture(scope="module")
def random_drafted(tiny_draft: str) -> LLM:
    return LLM(
        kv_cache_memory=KV_CACHE, dtype="float32", speculative_config=draft_config(tiny_draft)
    )


@pytest.fixture(scope="module")
def self_drafted() -> LLM:
    return LLM(
        kv_cache_memory=KV_CACHE,
        dtype="float32",
        speculative_config=draft_config(embedded_model_path()),
    )


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [
        plain.apply_chat_template([{"role": "user", "content": q}]) for q in COPYING + NOT_COPYING
    ]


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts) -> list:
    return [samples(plain.generate([p], greedy(32)))[0] for p in prompts]


def mixed_batch(plain: LLM, prompts) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests with a stop string, with logprobs, and ending at max_tokens 7 (k = 4:
    inside a second run of drafts), batched."""
    full = samples(plain.generate(prompts[:1], greedy(32)))[0]
    stop = full.text.split()[5]
    params = [
        SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]),
        greedy(24),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        greedy(16),
    ]
    return [prompts[0], prompts[1], prompts[2], prompts[3]], params


def same_outputs(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), (
            f"request {i}"
        )
        if w.logprobs is not None:
            assert [lp.logprob for lp in g.logprobs] == pytest.approx(
                [lp.logprob for lp in w.logprobs], abs=1e-4
            )


def test_random_draft_greedy_identical(random_drafted: LLM, plain: LLM, prompts, reference):
    stats = random_drafted.engine.core.scheduler.spec_decoding_stats
    got = [samples(random_drafted.generate([p], greedy(32)))[0] for p in prompts]
    assert_same_greedy("float32", reference, got)
    batch, params = mixed_batch(plain, prompts)
    same_outputs(
        samples(random_drafted.generate(batch, params)), samples(plain.generate(batch, params))
    )
    assert stats.num_drafts > 0  # a random draft's drafts are proposed, and mostly rejected
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert all_blocks_free(random_drafted)


def test_self_draft_accepted_and_identical(self_drafted: LLM, plain: LLM, prompts, reference):
    stats = self_drafted.engine.core.scheduler.spec_decoding_stats
    got = [samples(self_drafted.generate([p], greedy(32)))[0] for p in prompts]
    assert_same_greedy("float32", reference, got)
    # The same model drafts: its greedy tokens are the target's.
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
    # Far fewer target steps than tokens: every step verified up to 4 drafts.
    assert stats.num_drafts < 0.5 * sum(len(r.token_ids) for r in reference)
    batch, params = mixed_batch(plain, prompts)
    same_outputs(
        samples(self_drafted.generate(batch, params)), samples(plain.generate(batch, params))
    )
    for n in (1, 2, 3, 5, 6):
        out = samples(self_drafted.generate(prompts[:1], greedy(n)))[0]
        assert out.token_ids == reference[0].token_ids[:n] and out.finish_reason == "length"
    assert all_blocks_free(self_drafted)


def test_prefix_cache_hit_catches_the_draft_up(
    self_drafted: LLM, prompts, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The repeated prompt's blocks come from the cache, and so does the draft's K/V in them
    # (the draft wrote it for the same tokens the first time): the draft's catch-up starts at
    # the first uncached position, not at 0.
    kv = self_drafted.engine.core.kv_cache_manager
    stats = self_drafted.engine.core.scheduler.spec_decoding_stats
    drafter = self_drafted.engine.core.model_runner.drafter
    block_size = self_drafted.engine.core.model_runner.block_size
    samples(self_drafted.generate(prompts[:1], greedy(32)))  # cached, whatever ran before
    hits, drafted, accepted = (
        kv.prefix_cache_hits,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    starts: list[int] = []
    forward = drafter.runner.forward_chunks

    def spy(chunks):
        starts.extend(chunk.num_computed_tokens for chunk in chunks)
        return forward(chunks)

    monkeypatch.setattr(drafter.runner, "forward_chunks", spy)
    got = samples(self_drafted.generate(prompts[:1], greedy(32)))
    assert kv.prefix_cache_hits > hits
    assert_same_greedy("float32", reference[:1], got)
    assert stats.num_accepted_tokens - accepted > 0.8 * (stats.num_draft_tokens - drafted)
    cached = (len(prompts[0]) - 1) // block_size * block_size
    assert cached > 0 and starts and min(starts) >= cached, (cached, starts[:4])


@pytest.mark.parametrize("which", ["random", "self"])
def test_seeded_sampling_identical(which, random_drafted, self_drafted, plain, prompts) -> None:
    llm = random_drafted if which == "random" else self_drafted
    params = [
        SamplingParams(max_tokens=24, temperature=t, top_p=p, seed=s, ignore_eos=True, logprobs=1)
        for t, p, s in ((0.7, 1.0, 1), (1.0, 0.9, 2), (0.5, 0.95, 3))
    ]
    batch = prompts[:3]
    stats = llm.engine.core.scheduler.spec_decoding_stats
    drafts = stats.num_drafts
    want = samples(plain.generate(batch, params))
    same_outputs(samples(llm.generate(batch, params)), want)
    same_outputs(
        [samples(llm.generate([p], q))[0] for p, q in zip(batch, params, strict=True)], want
    )
    assert stats.num_drafts > drafts
    assert all_blocks_free(llm)


def test_chunked_prefill_and_preemption(self_drafted: LLM, plain: LLM, prompts) -> None:
    # 16 blocks for 5 requests of 37-114 prompt tokens: preempted ones start over with new blocks
    # (and the draft with them); 32-token prefill chunks run through the draft too.
    bytes_per_block = self_drafted.engine.core.model_runner.bytes_per_block()
    small = LLM(
        kv_cache_memory=16 * bytes_per_block,
        dtype="float32",
        enable_prefix_caching=False,
        max_num_batched_tokens=32,
        speculative_config=draft_config(embedded_model_path()),
    )
    assert small.engine.core.num_blocks == 16
    want = [samples(plain.generate([p], greedy(32)))[0] for p in prompts]
    got = samples(small.generate(prompts, greedy(32)))
    assert_same_greedy("float32", want, got)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    stats = small.engine.core.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens > 0
    assert all_blocks_free(small)


def test_kv_budget_shared_with_the_draft(plain: LLM, self_drafted: LLM, tiny_draft: str) -> None:
    target = plain.engine.core.model_runner.bytes_per_block()
    runner = self_drafted.engine.core.model_runner
    assert runner.drafter is not None
    assert runner.drafter.bytes_per_block() == target  # the same model drafts
    assert runner.bytes_per_block() == 2 * target
    assert plain.engine.core.num_blocks == KV_CACHE // target
    num_blocks = self_drafted.engine.core.num_blocks
    assert num_blocks == KV_CACHE // (2 * target)
    assert self_drafted.engine.core.cache_config_info.kv_cache_bytes == num_blocks * 2 * target
    # The draft's cache mirrors the target's block ids: as many blocks.
    assert runner.drafter.runner.kv_caches[0].shape[1] == num_blocks


def test_tiny_draft_takes_its_share_of_the_blocks(tmp_path: Path) -> None:
    target = save_tiny_llama(tmp_path / "target", 256, seed=1)
    draft = save_tiny_llama(tmp_path / "draft", 256, seed=2)
    budget = 4 * 1024**2
    plain = LLM(model=target, kv_cache_memory=budget, dtype="float32")
    spec = LLM(
        model=target,
        kv_cache_memory=budget,
        dtype="float32",
        speculative_config=draft_config(draft),
    )
    per_block = plain.engine.core.model_runner.bytes_per_block()
    draft_per_block = spec.engine.core.model_runner.drafter.bytes_per_block()
    assert plain.engine.core.num_blocks == budget // per_block
    assert spec.engine.core.num_blocks == budget // (per_block + draft_per_block)
    assert spec.engine.core.num_blocks < plain.engine.core.num_blocks
    ids = list(range(3, 40))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert spec.generate([ids], params)[0].outputs[0].token_ids == (
        plain.generate([ids], params)[0].outputs[0].token_ids
    )


def test_draft_with_another_vocabulary_refused(tmp_path: Path, tiny_draft: str) -> None:
    target = save_tiny_llama(tmp_path / "target", 256)
    with pytest.raises(ValueError, match=r"vocabulary of 49152 tokens, the target 256"):
        LLM(model=target, kv_cache_memory=4 * 1024**2, speculative_config=draft_config(tiny_draft))


def test_draft_with_a_shorter_context_refused(tmp_path: Path) -> None:
    target = save_tiny_llama(tmp_path / "target", 256)
    short = tmp_path / "short"
    save_tiny_llama(short, 256)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"context of 64 tokens, shorter than the served 128"):
        LLM(
            model=target,
            max_model_len=128,
            kv_cache_memory=4 * 1024**2,
            speculative_config=draft_config(str(short)),
        )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "must be 1"),
        ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "method ngram's"),
        ({"method": "ngram", "model": "d", "num_speculative_tokens": 3}, "method ngram does not"),
        ({"model": "d"}, "num_speculative_tokens is required"),
    ],
)
def test_draft_config_refusals(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(json.dumps(value))


def test_draft_config_parsed_and_refused_under_tensor_parallelism() -> None:
    for value in (
        {"model": "some/draft", "num_speculative_tokens": 3},
        {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 3},
        {"model": "some/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
    ):
        c = SpeculativeConfig.parse(json.dumps(value))
        assert c is not None and c.uses_draft_model and c.model == "some/draft"
        assert c.num_speculative_tokens == 3
        with pytest.raises(ValueError, match="tensor parallelism"):
            EngineConfig(speculative_config=json.dumps(value), tensor_parallel_size=2).validate()


def test_scheduler_reserves_placeholders_for_the_draft_model() -> None:
    from model_server.engine.core.kv_cache_manager import KVCacheManager
    from model_server.engine.core.request import Request
    from model_server.engine.core.scheduler import DRAFT_PLACEHOLDER, Scheduler, SchedulerConfig
    from model_server.engine.outputs import ModelRunnerOutput

    spec = SpeculativeConfig("draft_model", 3, 5, 5, 4, "some/draft")
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=True,
        block_size=4,
        speculative=spec,
        max_loras=None,
    )
    s = Scheduler(config, KVCacheManager(32, 4, True))
    assert s.proposer is None
    req = Request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3), eos_token_id=2)
    s.add_request(req)
    out = s.schedule()
    assert not out.scheduled_spec_decode_tokens  # the prefill samples plainly
    s.update_from_output(out, ModelRunnerOutput([9], [None]))
    out = s.schedule()
    # max_tokens 3 with 1 out: at most 1 draft, so that the step emits no more than 2.
    assert out.scheduled_spec_decode_tokens == {"a": [DRAFT_PLACEHOLDER]}
    assert out.num_scheduled_tokens == [2]
    out.scheduled_spec_decode_tokens["a"][0] = 11  # what the runner's draft model does
    s.update_from_output(out, ModelRunnerOutput([11], [None], None, [[12]], None))
    assert req.output_token_ids == [9, 11, 12] and req.is_finished
    assert (s.spec_decoding_stats.num_draft_tokens, s.spec_decoding_stats.num_accepted_tokens) == (
        1,
        1,
    )
