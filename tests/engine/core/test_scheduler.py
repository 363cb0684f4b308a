"""Scheduler: token budget, chunked prefill, FCFS, preemption, rejection, stop conditions, forks."""

from __future__ import annotations

import itertools
import time

import pytest

from model_server.config import EngineConfig
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.request import Request, RequestStatus
from model_server.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from model_server.engine.outputs import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs
from model_server.sampling_params import SamplingParams

EOS = 2
_arrivals = itertools.count()
_token_bases = itertools.count(1000, 1000)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        block_size=block_size,
        speculative=None,
        max_loras=None,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))


def make_request(
    request_id: str,
    num_prompt: int = 0,
    prompt: list[int] | None = None,
    parent: Request | None = None,
    **params,
) -> Request:
    """Distinct prompt tokens per request (no accidental prefix hits), increasing arrival."""
    if prompt is None:
        base = next(_token_bases)
        prompt = list(range(base, base + num_prompt))
    params.setdefault("max_tokens", 8)
    return Request(
        request_id,
        prompt,
        SamplingParams(**params),
        eos_token_id=EOS,
        arrival_time=float(next(_arrivals)),
        parent=parent,
    )


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake model that samples `token` for every request due to sample."""
    out = sched.schedule()
    sampled = [
        token if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True)
    ]
    sched.update_from_output(out, runner_output(sampled))
    return out


def runner_output(sampled: list[int | None]) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled, [None] * len(sampled))


def ids(outputs: list[EngineCoreOutput]) -> list[str]:
    return [o.request_id for o in outputs]


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {
        r.request_id: n
        for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True)
    }


def test_budget_shared_by_decodes_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    assert tokens_of(step(sched)) == {"a": 3, "b": 3}
    c = make_request("c", 20)
    sched.add_request(c)
    for chunk in (8, 8):
        out = step(sched)
        assert tokens_of(out) == {"a": 1, "b": 1, "c": chunk}
        assert out.total_num_scheduled_tokens == 10
        assert c.num_output_tokens == 0
    out = step(sched)
    assert tokens_of(out) == {"a": 1, "b": 1, "c": 4}
    assert c.num_computed_tokens == 20 and c.num_output_tokens == 1
    assert tokens_of(step(sched)) == {"a": 1, "b": 1, "c": 1}


def test_long_prompt_is_chunked_over_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    a = make_request("a", 19)
    sched.add_request(a)
    for chunk, computed, num_blocks in ((8, 8, 2), (8, 16, 4), (3, 19, 5)):
        out = sched.schedule()
        assert tokens_of(out) == {"a": chunk}
        # The block table covers the chunk before it runs; num_computed_tokens moves on update.
        assert len(a.block_ids) == num_blocks
        assert a.num_computed_tokens == computed - chunk
        sampled = [7] if computed == 19 else [None]
        outputs = sched.update_from_output(out, runner_output(sampled))
        assert ids(outputs) == (["a"] if computed == 19 else [])
        assert a.num_computed_tokens == computed
    assert a.output_token_ids == [7]
    assert a.first_token_time is not None
    assert tokens_of(step(sched)) == {"a": 1}


def test_max_num_seqs_and_fcfs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(name, 3, max_tokens=1 if name == "a" else 4) for name in "abc"]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert [r.request_id for r in out.scheduled_requests] == ["a", "b"]
    assert sched.num_running == 1 and sched.num_waiting == 1  # a finished (max_tokens=1)
    out = step(sched)
    assert tokens_of(out) == {"b": 1, "c": 3}
    assert [r.request_id for r in sched.running] == ["b", "c"]


def test_fcfs_under_a_small_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=5)
    for name in "abc":
        sched.add_request(make_request(name, 3))
    assert tokens_of(step(sched)) == {"a": 3, "b": 2}
    assert tokens_of(step(sched)) == {"a": 1, "b": 1, "c": 3}


def test_without_chunked_prefill_a_prefill_waits_for_a_whole_budget() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=8,
            max_model_len=16,
            enable_chunked_prefill=False,
            block_size=4,
            speculative=None,
            max_loras=None,
        )
    sched = make_scheduler(
        max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False
    )
    a1, a2 = make_request("a1", 2, max_tokens=2), make_request("a2", 2, max_tokens=2)
    sched.add_request(a1)
    sched.add_request(a2)
    assert tokens_of(step(sched)) == {"a1": 2, "a2": 2}
    b, c = make_request("b", 15, max_tokens=1), make_request("c", 2)
    sched.add_request(b)
    sched.add_request(c)
    # b needs 15 tokens, only 14 are left after the decodes; c must not overtake it.
    assert tokens_of(step(sched)) == {"a1": 1, "a2": 1}
    assert a1.is_finished and a2.is_finished
    assert tokens_of(step(sched)) == {"b": 15}
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert tokens_of(step(sched)) == {"c": 2}


def test_preemption_when_blocks_run_out_and_resume_first() -> None:
    sched = make_scheduler(num_blocks=6, block_size=2)
    kv = sched.kv_cache_manager
    a, b = make_request("a", 4, max_tokens=6), make_request("b", 4, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        out = step(sched)
        assert out.preempted_requests == []
    assert (a.num_tokens, b.num_tokens) == (7, 7)
    assert kv.num_free_blocks == 0
    c = make_request("c", 2, max_tokens=1)
    sched.add_request(c)

    # a needs a 4th block: b, the most recently arrived, is preempted and c is not admitted.
    out = step(sched)
    assert tokens_of(out) == {"a": 1}
    assert out.preempted_requests == [b]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions_total == 1
    assert list(sched.waiting) == [b, c]
    assert b.output_token_ids == [7, 7, 7]

    # b must recompute 7 tokens (4 blocks), only 2 are free: c behind it is not let through.
    assert tokens_of(step(sched)) == {"a": 1}
    assert tokens_of(step(sched)) == {"a": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH and kv.num_free_blocks == 6

    out = step(sched)
    assert tokens_of(out) == {"b": 7, "c": 2}
    assert [r.request_id for r in sched.running] == ["b"]  # c finished (max_tokens=1)
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 4
    for _ in range(2):
        step(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [7] * 6
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == 6


def test_last_running_request_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=5, block_size=2)
    a, b = make_request("a", 3), make_request("b", 6, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert (len(a.block_ids), len(b.block_ids)) == (2, 3)
    out = step(sched)  # a still fits its 2 blocks; b needs a 4th and is the last one
    assert tokens_of(out) == {"a": 1}
    assert out.preempted_requests == [b]
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_no_starvation_of_the_head_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", 20, max_tokens=4)
    sched.add_request(a)
    assert tokens_of(step(sched)) == {"a": 20}
    b = make_request("b", 16, max_tokens=4)
    c = make_request("c", 2, max_tokens=4)
    sched.add_request(b)
    sched.add_request(c)
    # a's decode takes a 6th block; b needs 4 of the 2 left; c would fit but must not overtake.
    while not a.is_finished:
        assert tokens_of(step(sched)) == {"a": 1}
        assert list(sched.waiting) == [b, c]
    assert tokens_of(step(sched)) == {"b": 16, "c": 2}


def test_rejections() -> None:
    sched = make_scheduler(max_model_len=32, num_blocks=64)
    with pytest.raises(ValueError) as exc:
        sched.add_request(make_request("long", 30, max_tokens=4))
    assert str(exc.value) == (
        "This model's maximum context length is 32 tokens. However, you requested 34 tokens "
        "(30 in the messages, 4 in the completion). Please reduce the length of the messages "
        "or completion."
    )
    with pytest.raises(
        ValueError,
        match=r"maximum context length is 32 tokens\. However, your prompt has 32 tokens",
    ):
        sched.add_request(make_request("fill", 32, max_tokens=None))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", prompt=[]))
    sched.add_request(make_request("ok", 31, max_tokens=None))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))

    small = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError) as exc:
        small.add_request(make_request("big", 10, max_tokens=8))
    assert str(exc.value).startswith(
        "This request needs 5 KV cache blocks (18 tokens: 10 in the messages, 8 in the "
        "completion) but the cache has only 4 blocks of 4 tokens (16 tokens)."
    )
    small.add_request(make_request("fits", 10, max_tokens=7))  # K/V of 16 tokens at most
    assert small.num_waiting == 1


@pytest.mark.parametrize(
    ("params", "tokens", "status", "num_outputs", "stop_reason"),
    [
        ({}, [5, EOS, 5], RequestStatus.FINISHED_STOPPED, 2, None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS] * 5, RequestStatus.FINISHED_LENGTH, 3, None),
        ({"stop_token_ids": [9]}, [5, 9, 5], RequestStatus.FINISHED_STOPPED, 2, 9),
        ({"min_tokens": 3}, [EOS, 9, EOS, 5], RequestStatus.FINISHED_STOPPED, 3, None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], RequestStatus.FINISHED_STOPPED, 2, 9),
        ({"max_tokens": 4}, [5] * 6, RequestStatus.FINISHED_LENGTH, 4, None),
        ({"max_tokens": 1}, [EOS], RequestStatus.FINISHED_STOPPED, 1, None),
        ({"max_tokens": None}, [5] * 12, RequestStatus.FINISHED_LENGTH, 11, None),
    ],
)
def test_stop_conditions(params, tokens, status, num_outputs, stop_reason) -> None:
    sched = make_scheduler(max_model_len=16)
    r = make_request("r", 5, **params)
    sched.add_request(r)
    for token in tokens:
        out = step(sched, token)
        if r.is_finished:
            break
    assert r.status == status
    assert r.num_output_tokens == num_outputs
    assert r.output_token_ids == tokens[:num_outputs]
    assert r.stop_reason == stop_reason
    assert r in out.scheduled_requests
    assert r.block_ids == [] and sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == ["r"]


def test_update_returns_requests_with_new_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b = make_request("a", 2), make_request("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert tokens_of(out) == {"a": 2, "b": 4}
    [output] = sched.update_from_output(out, runner_output([5, None]))
    assert (output.request_id, output.new_token_ids, output.finish_reason) == ("a", [5], None)
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.update_from_output(sched.schedule(), runner_output([5]))


def test_finish_requests_frees_blocks_and_is_idempotent() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    kv = sched.kv_cache_manager
    a = make_request("a", 10, max_tokens=4)
    b = make_request("b", 10, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1 and kv.num_free_blocks == 1
    assert sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert kv.num_free_blocks == 4 and sched.num_running == 0
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []
    assert sched.finish_requests("b", RequestStatus.FINISHED_STOPPED) == [b]
    assert sched.num_waiting == 0 and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests("b", RequestStatus.RUNNING)

    # Aborted while its step runs: the step's result is dropped, the blocks stay free.
    c = make_request("c", 3)
    sched.add_request(c)
    out = sched.schedule()
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_output([7])) == []
    assert c.output_token_ids == [] and kv.num_free_blocks == 4


def test_aborting_100000_waiting_requests_is_one_pass() -> None:
    """A flood of waiting requests aborted at once (a dropped multi-prompt request, a drain on
    SIGTERM) costs O(n): 100,000 in well under a second (it was O(n^2), hours)."""
    sched = make_scheduler(max_model_len=64)
    sched.add_request(make_request("kept", num_prompt=3))
    step(sched)
    n = 100_000
    for i in range(n):
        sched.add_request(make_request(f"w{i}", prompt=[5], max_tokens=1))
    assert sched.num_waiting == n
    start = time.perf_counter()
    finished = sched.finish_requests([f"w{i}" for i in range(n)], RequestStatus.FINISHED_ABORTED)
    elapsed = time.perf_counter() - start
    assert len(finished) == n
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert sched.num_waiting == 0 and [r.request_id for r in sched.running] == ["kept"]
    assert set(sched.requests) == {"kept"}


def test_n_samples_fork_the_parent_prompt() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=32)
    kv = sched.kv_cache_manager
    parent = make_request("p", 10)
    c1 = make_request("p-1", prompt=parent.prompt_token_ids, parent=parent)
    c2 = make_request("p-2", prompt=parent.prompt_token_ids, parent=parent)
    d = make_request("d", 3)
    for r in (parent, c1, c2, d):
        sched.add_request(r)
    # The parent's prompt is not computed yet: its siblings wait, without blocking d.
    assert tokens_of(step(sched)) == {"p": 10, "d": 3}
    assert list(sched.waiting) == [c1, c2]
    out = step(sched)
    assert tokens_of(out) == {"p": 1, "d": 1, "p-1": 2, "p-2": 2}
    shared = parent.block_ids[:2]
    assert c1.block_ids[:2] == shared and c2.block_ids[:2] == shared
    assert [kv.blocks[i].ref_cnt for i in shared] == [3, 3]
    assert len({c1.block_ids[2], c2.block_ids[2], parent.block_ids[2]}) == 3
    assert (c1.num_cached_tokens, c1.num_computed_tokens, c1.num_output_tokens) == (8, 10, 1)
    assert [r.request_id for r in sched.running] == ["p", "p-1", "p-2", "d"]
    sched.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert [kv.blocks[i].ref_cnt for i in shared] == [2, 2]


def test_sibling_waits_for_a_chunked_parent_prefill() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6)
    parent = make_request("p", 10)
    child = make_request("p-1", prompt=parent.prompt_token_ids, parent=parent)
    sched.add_request(parent)
    sched.add_request(child)
    assert tokens_of(step(sched)) == {"p": 6}
    assert tokens_of(step(sched)) == {"p": 4}
    assert tokens_of(step(sched)) == {"p": 1, "p-1": 2}


def test_prefix_cache_hit_through_the_scheduler() -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    a = make_request("a", 10, max_tokens=1)
    sched.add_request(a)
    step(sched)
    assert a.is_finished
    b = make_request("b", prompt=[*a.prompt_token_ids[:9], 1, 1], max_tokens=1)
    sched.add_request(b)
    out = step(sched)
    assert tokens_of(out) == {"b": 3}
    assert b.num_cached_tokens == 8
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (21, 8)


def _prompt_logprobs_step(sched: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One step whose fake model also gives prompt logprobs (logprob -position) for the rows of
    requests that compute them, as the model runner does."""
    out = sched.schedule()
    sampled: list[int | None] = []
    prompt_lps: list[list[TokenLogprobs] | None] = []
    for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens, strict=True):
        start = r.num_computed_tokens
        sampled.append(7 if start + n == r.num_tokens else None)
        rows = min(start + n, r.num_prompt_tokens - 1) - start
        if r.computes_prompt_logprobs and rows > 0:
            targets = r.prompt_token_ids[start + 1 : start + 1 + rows]
            prompt_lps.append(
                [TokenLogprobs(t, -float(start + 1 + i), []) for i, t in enumerate(targets)]
            )
        else:
            prompt_lps.append(None)
    outputs = sched.update_from_output(
        out, ModelRunnerOutput(sampled, [None] * len(sampled), prompt_lps)
    )
    return out, outputs


def test_prompt_logprobs_skip_the_prefix_cache_and_gather_over_chunks() -> None:
    """A request with prompt_logprobs takes no prefix-cache hit, gathers its positions chunk by
    chunk (again from the start after a preemption) and hands them out with its first output;
    max_tokens=0 finishes it there, with no token."""
    sched = make_scheduler(block_size=4, enable_prefix_caching=True, max_num_batched_tokens=6)
    a = make_request("a", 10, max_tokens=1)
    sched.add_request(a)
    while not a.is_finished:
        step(sched)
    b = make_request("b", prompt=list(a.prompt_token_ids), max_tokens=0, prompt_logprobs=1)
    sched.add_request(b)
    out, outputs = _prompt_logprobs_step(sched)
    assert tokens_of(out) == {"b": 6} and b.num_cached_tokens == 0 and outputs == []
    # Preempted mid-prefill: recomputed from scratch, the positions overwritten, not appended.
    sched.running.remove(b)
    sched._preempt(b)
    for _ in range(2):
        out, outputs = _prompt_logprobs_step(sched)
    (done,) = outputs
    assert done.new_token_ids == [] and done.finish_reason == "length" and b.is_finished
    assert done.prompt_logprobs is not None
    assert [e.token_id for e in done.prompt_logprobs] == b.prompt_token_ids[1:]
    assert [e.logprob for e in done.prompt_logprobs] == [-float(p) for p in range(1, 10)]
    # With max_tokens > 0: only the first output carries them.
    c = make_request("c", 5, max_tokens=2, prompt_logprobs=0)
    sched.add_request(c)
    _, (first,) = _prompt_logprobs_step(sched)
    _, (second,) = _prompt_logprobs_step(sched)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 4
    assert second.prompt_logprobs is None and c.output_token_ids == [7, 7]


def test_config_from_engine_config() -> None:
    engine = EngineConfig(max_num_batched_tokens=512, enable_chunked_prefill=False, block_size=8)
    config = SchedulerConfig.from_engine_config(engine, max_model_len=2048)
    assert config.max_num_batched_tokens == 2048 and config.block_size == 8
    with pytest.raises(ValueError, match="block_size mismatch"):
        Scheduler(config, KVCacheManager(8, 16))


class _CountingGrammar:
    """A grammar of exactly `length` tokens, any token allowed: the scheduler's side of the
    GrammarState contract (accept each sampled token once; stop once terminated)."""

    def __init__(self, length: int, reject: int | None = None) -> None:
        self.accepted: list[int] = []
        self.length = length
        self.reject = reject

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.reject:
            return False
        self.accepted.append(token_id)
        return True

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_a_terminated_grammar_stops_the_request_even_with_ignore_eos() -> None:
    sched = make_scheduler()
    req = make_request("g", 4, max_tokens=8, ignore_eos=True)
    req.grammar = _CountingGrammar(3)
    sched.add_request(req)
    for _ in range(3):
        step(sched, token=9)
    assert req.grammar.accepted == [9, 9, 9]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.num_output_tokens == 3


def test_a_rejected_token_aborts_the_request() -> None:
    sched = make_scheduler()
    req = make_request("g", 4, max_tokens=8)
    req.grammar = _CountingGrammar(5, reject=7)
    sched.add_request(req)
    step(sched, token=7)
    assert req.status == RequestStatus.FINISHED_ABORTED
