"""Speculative decoding's pure parts: the n-gram proposer, greedy acceptance, the config, the
policy, the scheduler's draft bookkeeping (KV blocks, limits, counters) with a scripted runner."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from model_server.config import EngineConfig, SpeculativeConfig
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.request import Request, RequestStatus
from model_server.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from model_server.engine.outputs import ModelRunnerOutput
from model_server.engine.spec_decode.metrics import SpecDecodingStats
from model_server.engine.spec_decode.ngram_proposer import NgramProposer
from model_server.engine.spec_decode.policy import (
    MAX_PAUSE_STEPS,
    AcceptanceFeedback,
    batch_speculates,
    request_speculates,
)
from model_server.engine.spec_decode.verify import accept_drafts
from model_server.sampling_params import SamplingParams

# ------------------------------------------------------------------------------ proposer


def test_proposer_takes_the_longest_suffix_ngram() -> None:
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # Suffix [7, 8] occurs at 0 (followed by 1, 2) and [8] alone at 5 (followed by 9): the
    # longer match wins although the shorter one is later.
    assert p.propose([7, 8, 1, 2, 3, 8, 9, 7, 8]) == [1, 2, 3]


def test_proposer_prefers_the_latest_occurrence_and_caps_k() -> None:
    p = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert p.propose([1, 2, 10, 11, 1, 2, 20, 21, 22, 1, 2]) == [20, 21]
    assert p.propose([1, 2, 10, 11, 1, 2, 20, 21, 22, 1, 2], max_drafts=1) == [20]
    assert p.propose([1, 2, 10, 11, 1, 2], max_drafts=0) == []


def test_proposer_respects_min_and_max() -> None:
    tokens = [5, 6, 7, 1, 9, 9, 6, 7]  # suffix [6, 7] occurs earlier, [5, 6, 7] does not
    assert NgramProposer(3, 3, 4).propose(tokens) == []  # needs 3 tokens of match
    assert NgramProposer(3, 2, 4).propose(tokens) == [1, 9, 9]
    assert NgramProposer(3, 1, 1).propose([3, 4, 3]) == [4, 3]
    assert NgramProposer(3, 1, 1).propose([3, 4, 5]) == []  # no earlier match
    assert NgramProposer(3, 2, 2).propose([3]) == []  # too short to match


def test_proposer_continuation_may_run_into_the_suffix_itself() -> None:
    # A repeating pattern: the latest match ends right before the suffix, so its continuation
    # is the suffix's own tokens (only as many as there are).
    assert NgramProposer(4, 2, 3).propose([1, 2, 1, 2, 1, 2]) == [1, 2]
    assert NgramProposer(4, 1, 5).propose([5, 5, 5]) == [5]


def test_proposer_matches_a_brute_force_search() -> None:
    import random

    rng = random.Random(0)

    def brute(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                return tokens[starts[-1] + n : starts[-1] + n + k]
        return []

    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert NgramProposer(k, lo, hi).propose(tokens) == brute(tokens, k, lo, hi), tokens


def test_proposer_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 1, 2)


# ----------------------------------------------------------------------------- acceptance


def test_accept_drafts() -> None:
    assert accept_drafts([1, 2, 3], [1, 2, 3, 4]) == 3  # all accepted, 4 is the bonus
    assert accept_drafts([1, 2, 3], [1, 5, 3, 4]) == 1  # 5 corrects the second draft
    assert accept_drafts([1, 2, 3], [9, 2, 3, 4]) == 0
    with pytest.raises(ValueError):
        accept_drafts([1, 2], [1, 2])


# --------------------------------------------------------------------------------- config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_config_defaults_as_vllm() -> None:
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert c == SpeculativeConfig("ngram", 3, 5, 5, 4)
    c = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("  ") is None


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
        ({"num_speculative_tokens": 3}, "method"),
        ({**NGRAM, "model": "HuggingFaceTB/SmolLM2-135M"}, "model"),
        ({**NGRAM, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": -1}, "prompt_lookup_max"),
        ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({**NGRAM, "disable_by_batch_size": 1}, "disable_by_batch_size"),
        ("[1, 2]", "JSON object"),
        ("{not json", "JSON object"),
    ],
)
def test_config_refuses_what_it_cannot_do(value, names: str) -> None:
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.parse(text)
    with pytest.raises(ValueError, match=names):
        EngineConfig(speculative_config=text).validate()


def test_config_refused_with_tensor_parallelism() -> None:
    config = EngineConfig(speculative_config=json.dumps(NGRAM), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        config.validate()


def test_cli_flag_refuses_bad_config_with_exit_code_2() -> None:
    import subprocess
    import sys

    bad = json.dumps({"method": "eagle", "num_speculative_tokens": 3})
    for command in ("serve", "generate"):
        proc = subprocess.run(
            [sys.executable, "-m", "model_server", command, "--speculative-config", bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (command, proc.stderr)
        assert "speculative_config: method 'eagle' is not supported" in proc.stderr


def test_environment_variable_refuses_bad_config() -> None:
    from model_server.settings_spec import SETTINGS_BY_NAME

    setting = SETTINGS_BY_NAME["speculative_config"]
    with pytest.raises(ValueError, match=r"LLM_SPECULATIVE_CONFIG.*num_speculative_tokens"):
        setting.from_env_text('{"method": "ngram"}')


# --------------------------------------------------------------------------------- policy


def test_policy() -> None:
    assert batch_speculates(3, 4) and not batch_speculates(4, 4)
    greedy = SamplingParams(temperature=0)
    assert request_speculates(greedy, 0, False)
    assert request_speculates(SamplingParams(temperature=0, logit_bias={1: 2.0}), 0, False)
    assert not request_speculates(greedy, 0, True)  # a grammar
    assert request_speculates(SamplingParams(temperature=0.7, seed=3), 0, False)
    assert not request_speculates(SamplingParams(temperature=0, presence_penalty=0.5), 0, False)
    assert not request_speculates(SamplingParams(temperature=0, min_tokens=3), 2, False)
    assert request_speculates(SamplingParams(temperature=0, min_tokens=3), 3, False)


def test_acceptance_feedback_backs_off_a_request_whose_drafts_miss() -> None:
    """Misses halve the drafts (at least 1) and, from the second in a row, pause proposals for
    1, 2, 4, ... steps (at most MAX_PAUSE_STEPS), counted in output tokens; a full acceptance
    doubles the limit back to k, a partial one keeps it, either ends the run of misses."""
    fb = AcceptanceFeedback(4)
    assert fb.max_drafts("a", 10) == 4  # never verified: k
    fb.observe("a", 4, 0, 11)  # first miss: 2 drafts, no pause
    assert fb.max_drafts("a", 11) == 2
    fb.observe("a", 2, 0, 12)  # second: 1 draft after a pause of 1 step
    assert fb.max_drafts("a", 12) == 0 and fb.max_drafts("a", 13) == 1
    fb.observe("a", 1, 0, 14)  # third: a pause of 2
    assert [fb.max_drafts("a", n) for n in (14, 15, 16)] == [0, 0, 1]
    for _ in range(4, 12):  # misses 4..11: pauses 4, 8, 16, then capped
        fb.observe("a", 1, 0, 100)
    assert fb.max_drafts("a", 100 + MAX_PAUSE_STEPS - 1) == 0
    assert fb.max_drafts("a", 100 + MAX_PAUSE_STEPS) == 1  # the pause is capped
    fb.observe("a", 1, 1, 200)  # a hit: the run of misses ends, the limit doubles
    assert fb.max_drafts("a", 200) == 2
    fb.observe("a", 2, 1, 202)  # a partial hit keeps the limit
    assert fb.max_drafts("a", 202) == 2
    fb.observe("a", 2, 2, 205)
    fb.observe("a", 4, 4, 210)
    assert fb.max_drafts("a", 210) == 4  # never past k
    fb.observe("a", 4, 0, 211)  # a miss after hits is a first miss again: no pause
    assert fb.max_drafts("a", 211) == 2
    assert fb.max_drafts("b", 0) == 4  # per request
    fb.forget("a")
    assert fb.max_drafts("a", 0) == 4


def test_a_request_whose_drafts_land_keeps_k() -> None:
    fb = AcceptanceFeedback(3)
    for n in range(10):
        fb.observe("a", 3, 3 if n % 2 else 2, 4 * n)  # every verification accepts something
        assert fb.max_drafts("a", 4 * n) == 3


# --------------------------------------------------------- scheduler with a scripted runner

BS = 4


def make_scheduler(
    num_blocks: int = 64,
    k: int = 3,
    budget: int = 64,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    disable_by_batch_size: int = 4,
) -> Scheduler:
    spec = SpeculativeConfig("ngram", k, 1, 3, disable_by_batch_size)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        block_size=BS,
        speculative=spec,
        max_loras=None,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, prefix_caching))


def make_request(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 20)
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=2)


class ScriptedRunner:
    """A 'model' that always continues the sequence `text` (a cycle): the target's token after
    a prefix is the text's next token after its last, so drafts copied from the cycle are
    accepted until the script says otherwise."""

    def __init__(self, text: list[int]) -> None:
        self.next = {a: b for a, b in zip(text, text[1:] + text[:1], strict=True)}

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: list[int | None] = []
        spec: list[list[int]] = []
        for req, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True):
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id, [])
            if req.num_computed_tokens + n - len(drafts) < req.num_tokens:
                sampled.append(None)
                spec.append([])
                continue
            targets = [self.next[t] for t in [req.all_token_ids[-1], *drafts]]
            accepted = accept_drafts(drafts, targets) if drafts else 0
            sampled.append(targets[0])
            spec.append(targets[1 : accepted + 1])
        return ModelRunnerOutput(sampled, [None] * len(sampled), None, spec, None)


def run(scheduler: Scheduler, runner: ScriptedRunner, max_steps: int = 200) -> list:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        for req, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True):
            assert len(req.block_ids) * BS >= req.num_computed_tokens + n
        outputs.append((out, scheduler.update_from_output(out, runner(out))))
    return outputs


CYCLE = [10, 11, 12, 13, 14, 15, 16, 17]


def test_drafts_are_scheduled_verified_and_counted() -> None:
    s = make_scheduler(k=3)
    req = make_request("a", CYCLE + CYCLE[:3], max_tokens=13)
    s.add_request(req)
    steps = run(s, ScriptedRunner(CYCLE))
    # The cycle continues: the output is the cycle from where the prompt stopped.
    expected = (CYCLE * 3)[3 : 3 + 13]
    assert req.output_token_ids == expected
    assert req.status == RequestStatus.FINISHED_LENGTH
    # Every decode step after the prefill verified drafts, all accepted; never past max_tokens.
    decode_steps = [o for o, _ in steps[1:]]
    assert all(o.scheduled_spec_decode_tokens for o in decode_steps)
    stats = s.spec_decoding_stats
    assert stats.num_drafts == len(decode_steps)
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert 1 + len(decode_steps) < 13  # fewer steps than tokens
    assert s.kv_cache_manager.num_free_blocks == 64


def test_rejection_trims_blocks_and_keeps_counts_consistent() -> None:
    s = make_scheduler(k=3, prefix_caching=True)
    kv = s.kv_cache_manager
    # 7 prompt tokens; drafts after the first output 9 are [1, 2, 3] (from "9 1 2 3" earlier).
    req = make_request("a", [9, 1, 2, 3, 4, 5, 6], max_tokens=8)
    s.add_request(req)

    class Script:
        def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
            drafts = out.scheduled_spec_decode_tokens.get("a", [])
            if req.num_computed_tokens == 0:
                return ModelRunnerOutput([9], [None])  # prefill samples 9
            # The target accepts the first draft only, then says 7.
            targets = [drafts[0], 7, 0, 0][: len(drafts) + 1] if drafts else [8]
            accepted = accept_drafts(drafts, targets) if drafts else 0
            return ModelRunnerOutput([targets[0]], [None], None, [targets[1 : accepted + 1]])

    script = Script()
    out = s.schedule()
    s.update_from_output(out, script(out))
    assert req.num_tokens == 8 and req.num_computed_tokens == 7 and len(req.block_ids) == 2
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert out.num_scheduled_tokens == [4]
    # Positions 7..10: blocks for 11 tokens (3), the third only for the drafts.
    assert len(req.block_ids) == 3
    third = req.block_ids[2]
    s.update_from_output(out, script(out))
    # Accepted: 1; emitted 1, 7. Computed: token 9 (pos 7) and draft 1 (pos 8).
    assert req.output_token_ids == [9, 1, 7]
    assert req.num_computed_tokens == 9 and req.num_tokens == 10
    assert len(req.block_ids) == 3  # 9 computed tokens need 3 blocks: the third keeps pos 8
    assert third in req.block_ids
    # Only the two full blocks of correct tokens are cached; the third holds a rejected slot.
    assert kv.num_cached_blocks == 2
    st = s.spec_decoding_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 1)
    assert st.num_accepted_tokens_per_pos == [1, 0, 0]
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 64


def test_trim_frees_whole_blocks_of_rejected_drafts() -> None:
    kv = KVCacheManager(16, BS, True)
    req = make_request("a", list(range(100, 107)))
    assert kv.allocate_slots(req, 7, [], 0)
    req.num_computed_tokens = 7
    free = kv.num_free_blocks
    assert kv.allocate_slots(req, 6)  # positions 7..12: blocks 2 and 3 more
    assert kv.num_free_blocks == free - 2
    kv.trim(req, 8)  # only position 7 kept
    assert len(req.block_ids) == 2 and kv.num_free_blocks == free


class Contrarian:
    """A 'model' over the tokens 3 and 4 whose token is never a request's first draft (the
    other one), 3 where nothing was drafted: the lookup always finds a match, every draft is
    rejected."""

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: list[int | None] = []
        for req, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True):
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id, [])
            done = req.num_computed_tokens + n - len(drafts) >= req.num_tokens
            sampled.append((7 - drafts[0] if drafts else 3) if done else None)
        return ModelRunnerOutput(sampled, [None] * len(sampled), None, [[] for _ in sampled])


def test_scheduler_backs_off_drafts_that_miss_and_keeps_those_that_land() -> None:
    """Every draft rejected: after the first miss the request drafts 1 token, from the second
    it pauses for 1, 2, 4, ... steps, so it verifies ever more rarely; the acceptance state is
    dropped when it finishes. A request whose drafts land keeps k."""
    s = make_scheduler(k=3)
    req = make_request("a", [3, 4, 3, 3, 4, 4, 3], max_tokens=40)
    s.add_request(req)
    steps = run(s, Contrarian())
    assert req.num_output_tokens == 40
    verified = [len(o.scheduled_spec_decode_tokens.get("a", [])) for o, _ in steps[1:]]
    stats = s.spec_decoding_stats
    assert stats.num_accepted_tokens == 0
    # Drafts at steps 0, 1 (halved), then after pauses of 1, 2, 4, 8, 16 plain steps.
    assert MAX_PAUSE_STEPS == 16
    assert [i for i, n in enumerate(verified) if n] == [0, 1, 3, 6, 11, 20, 37]
    assert [n for n in verified if n] == [3, 1, 1, 1, 1, 1, 1]
    assert "a" not in s.acceptance._requests
    s = make_scheduler(k=3)
    req = make_request("b", CYCLE + CYCLE[:3], max_tokens=25)
    s.add_request(req)
    steps = run(s, ScriptedRunner(CYCLE))
    drafts = [len(o.scheduled_spec_decode_tokens["b"]) for o, _ in steps[1:]]
    assert drafts[:-1] == [3] * (len(drafts) - 1)


def test_drafts_never_pass_max_tokens_or_max_model_len_or_the_budget() -> None:
    prompt = CYCLE * 2
    # max_tokens 3: one prefill token, then at most 1 draft (2 tokens left, one emitted free).
    s = make_scheduler(k=5)
    req = make_request("a", prompt, max_tokens=3)
    s.add_request(req)
    steps = run(s, ScriptedRunner(CYCLE))
    assert req.num_output_tokens == 3
    assert all(len(d) <= 1 for o, _ in steps for d in o.scheduled_spec_decode_tokens.values())
    # max_model_len 20 with a 16-token prompt: at most 4 tokens, never a draft past it.
    s = make_scheduler(k=5, max_model_len=20)
    req = make_request("b", prompt, max_tokens=None)
    s.add_request(req)
    run(s, ScriptedRunner(CYCLE))
    assert req.num_tokens == 20 and req.status == RequestStatus.FINISHED_LENGTH
    # A budget of 3 tokens: 1 + 2 drafts at most.
    s = make_scheduler(k=5, budget=3)
    req = make_request("c", prompt, max_tokens=10)
    s.add_request(req)
    steps = run(s, ScriptedRunner(CYCLE))
    assert all(o.total_num_scheduled_tokens <= 3 for o, _ in steps)
    assert any(o.scheduled_spec_decode_tokens for o, _ in steps)
    assert req.output_token_ids == (CYCLE * 3)[:10]


def test_eos_inside_accepted_drafts_truncates() -> None:
    s = make_scheduler(k=5)
    cycle = [10, 11, 2, 13]  # 2 is EOS
    req = make_request("a", [10, 11, 2, 13, 10], max_tokens=20)
    s.add_request(req)
    run(s, ScriptedRunner(cycle))
    # Output 11 (prefill), then drafts [2, 13, 10, ...] accepted: EOS stops at once.
    assert req.output_token_ids == [11, 2]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert s.kv_cache_manager.num_free_blocks == 64


def test_stop_token_inside_drafts_and_counts() -> None:
    s = make_scheduler(k=5)
    req = make_request("a", CYCLE + CYCLE[:2], max_tokens=20, stop_token_ids=[15])
    s.add_request(req)
    run(s, ScriptedRunner(CYCLE))
    assert req.output_token_ids == [12, 13, 14, 15]
    assert req.stop_reason == 15


def test_no_drafts_for_wide_batches_or_ineligible_requests() -> None:
    s = make_scheduler(k=3, disable_by_batch_size=2)
    a = make_request("a", CYCLE * 2, max_tokens=6)
    b = make_request("b", CYCLE * 2, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    steps = run(s, ScriptedRunner(CYCLE))
    assert not any(o.scheduled_spec_decode_tokens for o, _ in steps)
    s = make_scheduler(k=3)
    c = make_request("c", CYCLE * 2, max_tokens=6, min_tokens=5)
    d = make_request("d", CYCLE * 2, max_tokens=6, repetition_penalty=1.2)
    s.add_request(c)
    s.add_request(d)
    for _ in range(3):
        out = s.schedule()
        assert not out.scheduled_spec_decode_tokens
        s.update_from_output(out, ScriptedRunner(CYCLE)(out))


def test_stats_since_baseline() -> None:
    st = SpecDecodingStats(3)
    st.observe(3, 2)
    base = st.since(None)
    st.observe(2, 0)
    d = st.since(base)
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (1, 2, 0)
    assert d.num_accepted_tokens_per_pos == [0, 0, 0]
    assert st.num_accepted_tokens_per_pos == [1, 1, 0]


# ------------------------------------------------------- sampled verification, statistically


@dataclass(slots=True)
class _Row:
    """What the sampler reads of a request (layers/sampling/metadata.py's SamplingRequest)."""

    request_id: str
    sampling_params: SamplingParams
    sample_index: int = 0
    eos_token_id: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_sampled_verification_matches_the_target_distribution() -> None:
    """Drafts [2, 4] verified against three target rows on a 6-token vocabulary, 20000 times:
    the first emitted token is distributed as the target's first row (temperature 0.7, top-k 4),
    draft 2 is accepted with probability p0(2) (vLLM's min(1, p/q) for a one-hot draft), the
    token after an accepted draft as the second row, and a rejection's token as p0 without the
    draft (the normalized residual max(0, p - q))."""
    import torch

    from model_server.layers.sampler import Sampler

    torch.manual_seed(1234)
    vocab, trials = 6, 20000
    drafts = [2, 4]
    rows = torch.tensor(
        [[0.5, 1.0, 1.2, -0.3, 0.2, 0.8], [0.1, 0.2, 0.3, 0.4, 0.5, -0.5], [1.0, 0.0, 0, 0, 0, 0]]
    )
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=8)

    def target(row: torch.Tensor) -> list[float]:
        logits = row / 0.7
        keep = logits >= logits.topk(4).values[-1]
        return torch.where(keep, logits, torch.tensor(float("-inf"))).softmax(-1).tolist()

    p0, p1 = target(rows[0]), target(rows[1])
    requests = [_Row(f"r{t}", params) for t in range(trials) for _ in range(3)]
    sampler = Sampler("cpu")
    metadata = sampler.build_metadata(requests, vocab)
    tokens = sampler(rows.repeat(trials, 1), metadata).sampled_token_ids.view(trials, 3).tolist()
    first = [0] * vocab
    after_accept = [0] * vocab
    on_reject = [0] * vocab
    for t0, t1, t2 in tokens:
        accepted = accept_drafts(drafts, [t0, t1, t2])
        emitted = [t0, t1, t2][: accepted + 1]
        first[emitted[0]] += 1
        if accepted >= 1:
            after_accept[emitted[1]] += 1
        else:
            on_reject[emitted[0]] += 1
    # df <= 5; 20.5 is chi-square's 0.999 quantile there (fixed seed: deterministic anyway).
    assert _chi_square(first, p0) < 20.5
    assert _chi_square(after_accept, p1) < 20.5
    residual = [0.0 if i == drafts[0] else p for i, p in enumerate(p0)]
    residual = [p / sum(residual) for p in residual]
    assert on_reject[drafts[0]] == 0
    assert _chi_square(on_reject, residual) < 20.5
    assert sum(after_accept) / trials == pytest.approx(p0[drafts[0]], abs=0.015)
    # The test can tell: accepting every draft would put all mass on the draft.
    assert first[drafts[0]] / trials < 0.6


def test_rewound_generator_continues_as_one_token_decoding() -> None:
    """A seeded request verified 3 drafts of which 1 was accepted: its generator, rewound to
    2 rows' draws, is where sampling 2 tokens one at a time leaves it."""
    import torch

    from model_server.layers.sampler import Sampler

    params = SamplingParams(temperature=1.0, seed=99, max_tokens=8)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    one = Sampler("cpu")
    row = _Row("a", params)
    step_by_step = [
        one(logits[i : i + 1], one.build_metadata([row], 50)).sampled_token_ids.item()
        for i in range(4)
    ]
    spec = Sampler("cpu")
    spec(logits[:1], spec.build_metadata([row], 50))  # the prefill's token: creates the generator
    state = spec.generator_state("a")
    assert state is not None
    verified = spec(logits[1:4], spec.build_metadata([row] * 3, 50)).sampled_token_ids.tolist()
    assert verified == step_by_step[1:4]  # same draws, row by row
    spec.rewind("a", state, 2, 50)  # tokens 1 and 2 emitted
    again = spec(logits[3:4], spec.build_metadata([row], 50)).sampled_token_ids.item()
    assert again == step_by_step[3]
    assert spec.generator_state("greedy-never-drew") is None
