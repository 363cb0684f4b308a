"""AsyncLLM over a scripted fake engine: queues, aborts, errors, crashes, shutdown, stats.

The fake emits one token per request per step; `step_gate` lets a test hold the engine thread
between steps, so every interleaving below is deterministic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from model_server.config import EngineConfig
from model_server.engine.async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineNotReadyError,
    EnginePhase,
    RequestAbortedError,
    RequestOutputCollector,
)
from model_server.engine.outputs import CompletionOutput, RequestOutput
from model_server.engine.stats import IterationStats, SchedulerStats
from model_server.sampling_params import SamplingParams

MAX_LEN = 64


@dataclass
class _FakeRequest:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class FakeEngine:
    """Token k of a request is `k`; it finishes at max_tokens ("length")."""

    def __init__(self, config: EngineConfig) -> None:
        self.requests: dict[str, _FakeRequest] = {}
        self.aborted: list[str] = []
        self.abort_calls = 0
        self.step_gate = threading.Semaphore(1000)  # steps allowed before blocking
        self.fail_next_step = False
        self.steps = 0
        scheduler = SimpleNamespace(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            num_preemptions_total=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            spec_decoding_stats=None,
            requests=self.requests,
        )
        # What AsyncLLM reads of an LLMEngine (and nothing deeper).
        self.scheduler = scheduler
        self.vocab_size = 100
        self.max_model_len = MAX_LEN
        self.tokenizer = None

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        if isinstance(prompt, str):
            raise ValueError("this model has no tokenizer: pass prompt token ids instead")
        if len(prompt) + (params.max_tokens or 0) > MAX_LEN:
            raise ValueError("This model's maximum context length is 64 tokens.")
        if request_id in self.requests:
            raise ValueError("duplicate")
        self.requests[request_id] = _FakeRequest(list(prompt), params)
        self._update_gauges()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.abort_calls += 1
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
        self._update_gauges()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.step_gate.acquire()
        time.sleep(0.002)  # a real step takes time: lets aborts land mid-request
        self.steps += 1
        if self.fail_next_step:
            raise RuntimeError("boom")
        outputs = []
        for request_id, req in list(self.requests.items()):
            req.num_computed_tokens = len(req.prompt) + len(req.tokens)
            req.tokens.append(len(req.tokens))
            done = len(req.tokens) >= (req.params.max_tokens or 8)
            sample = CompletionOutput(
                index=0,
                text=" ".join(map(str, req.tokens)),
                token_ids=list(req.tokens),
                finish_reason="length" if done else None,
                text_delta=f"{req.tokens[-1]} ",
                token_ids_delta=[req.tokens[-1]],
            )
            outputs.append(RequestOutput(request_id, None, req.prompt, [sample], done))
            if done:
                del self.requests[request_id]
        self._update_gauges()
        return outputs

    def _update_gauges(self) -> None:
        self.scheduler.num_running = len(self.requests)


class RecordingLogger:
    def __init__(self) -> None:
        self.records: list[tuple[SchedulerStats, IterationStats]] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def started(**kwargs: Any) -> tuple[AsyncLLM, FakeEngine]:
    engines: list[FakeEngine] = []

    def factory(config: EngineConfig) -> FakeEngine:
        engines.append(FakeEngine(config))
        return engines[0]

    llm = AsyncLLM(EngineConfig(), engine_factory=factory, skip_warmup=True, **kwargs)
    await llm.start()
    await llm.wait_until_ready(timeout=10)
    return llm, engines[0]


async def collect(llm: AsyncLLM, request_id: str, **kw: Any) -> list[RequestOutput]:
    return [out async for out in llm.generate([1, 2, 3], params(**kw), request_id)]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_generate_streams_until_finished() -> None:
    async def main() -> None:
        llm, _ = await started()
        outs = await collect(llm, "a", max_tokens=3)
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2]
        assert "".join(o.outputs[0].text_delta for o in outs) == "0 1 2 "
        assert not any(o.finished for o in outs[:-1])
        await llm.shutdown()
        assert llm.phase is EnginePhase.STOPPED

    run(main())


def test_concurrent_requests_each_get_their_own_outputs() -> None:
    async def main() -> None:
        llm, _ = await started()
        results = await asyncio.gather(*(collect(llm, f"r{i}", max_tokens=2 + i) for i in range(8)))
        for i, outs in enumerate(results):
            assert {o.request_id for o in outs} == {f"r{i}"}
            assert outs[-1].outputs[0].token_ids == list(range(2 + i))
        assert llm.num_unfinished_requests == 0
        await llm.shutdown()

    run(main())


def test_add_request_error_is_raised_before_any_output_and_others_keep_going() -> None:
    async def main() -> None:
        llm, engine = await started()
        good = asyncio.ensure_future(collect(llm, "good", max_tokens=5))
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(llm, "bad", max_tokens=100)
        assert (await good)[-1].finished
        assert llm.phase is EnginePhase.READY and "bad" not in engine.aborted
        await llm.shutdown()

    run(main())


def test_cancelled_consumer_aborts_its_request() -> None:
    async def main() -> None:
        llm, engine = await started()
        engine.step_gate = threading.Semaphore(1)
        gen = llm.generate([1], params(max_tokens=50), "x")
        first = await anext(gen)
        assert not first.finished
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The thread is held inside a step; the abort applies right after it.
        engine.step_gate.release(1000)
        for _ in range(100):
            if "x" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["x"] and not engine.requests
        assert engine.steps < 10  # aborted long before its 50 tokens
        await llm.shutdown()

    run(main())


def test_aborts_queued_together_reach_the_engine_in_one_call() -> None:
    """A client dropping a many-prompt request queues one abort per prompt: the engine thread
    applies all of a drain's aborts in one engine call (one scheduler pass), not one each."""

    async def main() -> None:
        llm, engine = await started()
        engine.step_gate = threading.Semaphore(0)  # the thread blocks in its next step
        n = 3000
        gens = [llm.generate([1], params(max_tokens=50), f"r{i}") for i in range(n)]
        tasks = [asyncio.ensure_future(anext(gen)) for gen in gens]
        await asyncio.sleep(0.3)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        calls_before = engine.abort_calls
        engine.step_gate.release(10**6)
        for _ in range(500):
            if len(engine.aborted) == n and not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert sorted(engine.aborted) == sorted(f"r{i}" for i in range(n))
        assert engine.abort_calls - calls_before <= 2, engine.abort_calls
        assert llm.num_unfinished_requests == 0
        await llm.shutdown()

    run(main())


def test_closing_the_generator_early_aborts_its_request() -> None:
    async def main() -> None:
        llm, engine = await started()
        gen = llm.generate([1], params(max_tokens=50), "y")
        await anext(gen)
        await gen.aclose()
        for _ in range(100):
            if "y" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert "y" in engine.aborted
        await llm.shutdown()

    run(main())


def test_duplicate_request_id_is_refused() -> None:
    async def main() -> None:
        llm, engine = await started()
        engine.step_gate = threading.Semaphore(0)
        gen = llm.generate([1], params(), "dup")
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in use"):
            await anext(llm.generate([1], params(), "dup"))
        engine.step_gate.release(1000)
        await task
        await gen.aclose()
        await llm.shutdown()

    run(main())


def test_engine_crash_fails_pending_requests_and_turns_phase_to_error() -> None:
    async def main() -> None:
        llm, engine = await started()
        engine.step_gate = threading.Semaphore(0)
        pending = [asyncio.ensure_future(collect(llm, f"p{i}", max_tokens=20)) for i in range(3)]
        await asyncio.sleep(0.05)
        engine.fail_next_step = True
        engine.step_gate.release(1000)
        for task in pending:
            with pytest.raises(EngineDeadError, match="boom"):
                await task
        assert llm.phase is EnginePhase.ERROR and "boom" in (llm.error_message or "")
        with pytest.raises(EngineDeadError):
            await collect(llm, "late")
        assert "boom" in await asyncio.wait_for(llm.wait_until_failed(), 1)
        await llm.shutdown()  # never hangs on a dead engine
        assert llm.phase is EnginePhase.ERROR

    run(main())


def test_load_failure_is_an_error_phase_not_a_hang() -> None:
    async def main() -> None:
        def factory(config: EngineConfig) -> FakeEngine:
            raise FileNotFoundError("no such model: nope.gguf")

        llm = AsyncLLM(EngineConfig(), engine_factory=factory)
        await llm.start()
        with pytest.raises(EngineDeadError, match=r"nope\.gguf"):
            await llm.wait_until_ready(timeout=10)
        assert llm.phase is EnginePhase.ERROR
        await llm.shutdown()

    run(main())


def test_requests_before_ready_are_refused_with_the_phase() -> None:
    async def main() -> None:
        gate = threading.Event()

        def factory(config: EngineConfig) -> FakeEngine:
            gate.wait(10)
            return FakeEngine(config)

        llm = AsyncLLM(EngineConfig(), engine_factory=factory, skip_warmup=True)
        await llm.start()
        assert llm.phase is EnginePhase.LOADING
        with pytest.raises(EngineNotReadyError, match="loading"):
            await collect(llm, "early")
        gate.set()
        await llm.wait_until_ready(timeout=10)
        assert (await collect(llm, "later"))[-1].finished
        await llm.shutdown()

    run(main())


def test_shutdown_drains_in_flight_requests_and_refuses_new_ones() -> None:
    async def main() -> None:
        llm, _engine = await started()
        in_flight = asyncio.ensure_future(collect(llm, "inflight", max_tokens=10))
        await asyncio.sleep(0.02)
        shutdown = asyncio.ensure_future(llm.shutdown(drain_timeout=10))
        await asyncio.sleep(0)
        with pytest.raises(EngineNotReadyError, match="shutting down"):
            await collect(llm, "new")
        outs = await in_flight
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
        await shutdown
        assert llm.phase is EnginePhase.STOPPED

    run(main())


def test_shutdown_aborts_what_the_drain_timeout_leaves() -> None:
    async def main() -> None:
        llm, engine = await started()
        engine.step_gate = threading.Semaphore(1)
        stuck = asyncio.ensure_future(collect(llm, "stuck", max_tokens=50))
        await asyncio.sleep(0.05)
        shutdown = asyncio.ensure_future(llm.shutdown(drain_timeout=0.2))
        with pytest.raises(RequestAbortedError):
            await stuck
        engine.step_gate.release(1000)  # let the thread reach the stop command
        await shutdown
        assert "stuck" in engine.aborted and llm.phase is EnginePhase.STOPPED

    run(main())


def test_stat_loggers_see_tokens_ttft_and_finished_requests() -> None:
    async def main() -> None:
        stat_logger = RecordingLogger()
        llm, _ = await started(stat_loggers=[stat_logger])
        await collect(llm, "s", max_tokens=3)
        await llm.shutdown()
        its = [it for _, it in stat_logger.records]
        assert sum(it.num_generation_tokens for it in its) == 3
        assert sum(it.num_prompt_tokens for it in its) == 3
        assert len([t for it in its for t in it.time_to_first_tokens]) == 1
        assert len([t for it in its for t in it.inter_token_latencies]) == 2
        (finished,) = [f for it in its for f in it.finished]
        assert finished.finish_reason == "length" and finished.num_generation_tokens == 3
        assert finished.e2e_latency >= finished.decode_time >= 0
        # After the request is gone the gauges say so.
        assert stat_logger.records[-1][0].num_running == 0

    run(main())


def test_a_broken_stat_logger_does_not_stop_the_engine() -> None:
    class Broken:
        def record(self, *args: Any) -> None:
            raise RuntimeError("metrics bug")

    async def main() -> None:
        llm, _ = await started(stat_loggers=[Broken()])
        assert (await collect(llm, "ok"))[-1].finished
        assert llm.phase is EnginePhase.READY
        await llm.shutdown()

    run(main())


def test_collector_merges_deltas_for_a_slow_consumer() -> None:
    async def main() -> None:
        collector = RequestOutputCollector(asyncio.get_running_loop().create_future())

        def out(tokens: list[int], finished: bool = False) -> RequestOutput:
            sample = CompletionOutput(
                index=0,
                text="".join(f"t{t}" for t in tokens),
                token_ids=list(tokens),
                text_delta=f"t{tokens[-1]}",
                token_ids_delta=[tokens[-1]],
            )
            return RequestOutput("r", None, [1], [sample], finished)

        collector.put(out([0]))
        collector.put(out([0, 1]))
        collector.put(out([0, 1, 2], finished=True))
        merged = await collector.get()
        assert merged.finished and merged.outputs[0].text_delta == "t0t1t2"
        assert merged.outputs[0].token_ids_delta == [0, 1, 2]
        assert collector.get_nowait() is None
        collector.put(RuntimeError("x"))
        collector.put(out([3]))  # an error, once there, stays
        with pytest.raises(RuntimeError):
            collector.get_nowait()

    run(main())


def test_max_waiting_requests_refuses_at_once_and_admits_again_once_the_queue_moves() -> None:
    from model_server.engine.async_engine import EngineNotReadyError, EngineOverloadedError

    async def main() -> None:
        llm, engine = await started()
        llm.max_waiting_requests = 1
        engine.step_gate = threading.Semaphore(0)  # no step runs: what was added waits
        first = asyncio.ensure_future(collect(llm, "a"))
        await asyncio.sleep(0.05)
        assert llm.num_waiting_requests == 1
        with pytest.raises(EngineOverloadedError, match="--max-waiting-requests 1") as info:
            await collect(llm, "b")
        assert isinstance(info.value, EngineNotReadyError)  # the HTTP layer's 503 family
        engine.step_gate.release(1000)
        assert len(await first) == 4
        assert llm.num_waiting_requests == 0
        assert len(await collect(llm, "c")) == 4
        await llm.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
