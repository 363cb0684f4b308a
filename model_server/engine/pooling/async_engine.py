"""The pooling engine in a background thread, for the HTTP server.

`encode(requests)` hands one HTTP request's inputs to the engine thread and awaits their
outputs; the thread adds whatever arrived, steps until nothing waits, and resolves each HTTP
request's future on the event loop. Inputs of concurrent HTTP requests share steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from model_server.config import EngineConfig
from model_server.engine.async_engine import (
    EngineDeadError,
    EngineDrainingError,
    EngineNotReadyError,
    EnginePhase,
)
from model_server.engine.pooling.config import PoolerConfig
from model_server.engine.pooling.engine import PoolingEngine
from model_server.engine.pooling.request import PoolingOutput, PoolingRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    """One HTTP request's inputs; `future` gets their outputs in order, or the error."""

    requests: list[PoolingRequest]
    future: asyncio.Future[list[PoolingOutput]]
    outputs: dict[str, PoolingOutput] = field(default_factory=dict)


@dataclass(slots=True)
class _Abort:
    """The inputs of an HTTP request whose caller left: dropped from the queue unrun."""

    request_ids: list[str]


class AsyncPoolingEngine:
    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], PoolingEngine] = PoolingEngine,
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.engine: PoolingEngine | None = None
        self._phase = EnginePhase.LOADING
        self._accepting = True
        self._error: str | None = None
        self._jobs: queue.SimpleQueue[_Job | _Abort | None] = queue.SimpleQueue()
        self._pending = 0  # HTTP requests not answered yet (loop thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: asyncio.Event | None = None
        # Metrics hooks: `on_step(num_requests, num_tokens, seconds)` on the engine thread.
        self.step_listeners: list[Callable[[int, int, float], None]] = []

    @property
    def phase(self) -> EnginePhase:
        if not self._accepting and self._phase is EnginePhase.READY:
            return EnginePhase.DRAINING
        return self._phase

    @property
    def error_message(self) -> str | None:
        return self._error

    @property
    def pooler(self) -> PoolerConfig | None:
        return self.engine.pooler if self.engine is not None else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        return self.engine.max_model_len if self.engine is not None else None

    @property
    def num_unfinished_requests(self) -> int:
        return self._pending

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="wick-pooling", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self.begin_shutdown()
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self._pending and time.monotonic() < deadline and self._alive():
            await asyncio.sleep(0.05)
        if self._alive():
            self._jobs.put(None)
            await asyncio.to_thread(self._thread.join, 10.0)  # type: ignore[union-attr]
        if self._phase is not EnginePhase.ERROR:
            self._phase = EnginePhase.STOPPED

    async def wait_until_failed(self) -> str:
        assert self._failed is not None, "call start() first"
        await self._failed.wait()
        return self._error or "engine failed"

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_ready(self) -> None:
        if self._phase is EnginePhase.ERROR:
            raise EngineDeadError(self._error or "the engine failed")
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down")
        if self._phase is not EnginePhase.READY:
            raise EngineNotReadyError(f"the model is not ready yet ({self._phase.value})")

    async def encode(self, requests: list[PoolingRequest]) -> list[PoolingOutput]:
        """The outputs of `requests`, in order. Raises ValueError for a request the engine
        refuses (too long, wrong task), EngineNotReadyError / EngineDeadError otherwise.
        Cancelled (the client left), the inputs not yet run are dropped: none of them is run
        after the engine thread sees the abort, which it does before its next step."""
        self.check_ready()
        assert self._loop is not None
        job = _Job(requests, self._loop.create_future())
        self._pending += 1
        try:
            self._jobs.put(job)
            return await job.future
        except asyncio.CancelledError:
            self._jobs.put(_Abort([r.request_id for r in requests]))
            raise
        finally:
            self._pending -= 1

    @property
    def num_waiting_requests(self) -> int:
        """Inputs queued in the engine and not run yet (the scheduler's queue)."""
        return self.engine.scheduler.num_waiting if self.engine is not None else 0

    # --------------------------------------------------------------------- engine thread

    def _resolve(self, job: _Job, result: list[PoolingOutput] | BaseException) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        try:
            self.engine = self._engine_factory(self.config)
            self._phase = EnginePhase.READY
            logger.info("pooling engine ready (%s)", self.engine.pooler.task.value)
            self._serve(self.engine)
        except Exception as exc:  # the thread must report every failure
            logger.exception("pooling engine failed")
            self._error = f"{type(exc).__name__}: {exc}"
            self._phase = EnginePhase.ERROR
            if self._loop is not None and self._failed is not None:
                self._loop.call_soon_threadsafe(self._failed.set)
            while True:  # fail whatever is queued
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if isinstance(job, _Job):
                    self._resolve(job, EngineDeadError(self._error))

    def _serve(self, engine: PoolingEngine) -> None:
        # request id -> its job; a job is answered when all its requests have an output.
        owners: dict[str, _Job] = {}
        while True:
            block = not engine.has_unfinished_requests()
            # What arrived since the last step (nothing, between the steps of a long job).
            jobs: list[_Job | _Abort | None] = []
            try:
                jobs.append(self._jobs.get(block=block))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            for job in jobs:
                if job is None:
                    return
                if isinstance(job, _Abort):
                    engine.abort_requests(job.request_ids)
                    for request_id in job.request_ids:
                        owners.pop(request_id, None)
                    continue
                self._add(engine, job, owners)
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            for listener in self.step_listeners:
                listener(len(outputs), sum(o.num_prompt_tokens for o in outputs), seconds)
            for output in outputs:
                job = owners.pop(output.request_id)  # a step runs before any abort of it
                job.outputs[output.request_id] = output
                if len(job.outputs) == len(job.requests):
                    self._resolve(job, [job.outputs[r.request_id] for r in job.requests])

    def _add(self, engine: PoolingEngine, job: _Job, owners: dict[str, _Job]) -> None:
        added: list[str] = []
        try:
            for request in job.requests:
                engine.add_request(request)
                owners[request.request_id] = job
                added.append(request.request_id)
        except ValueError as exc:
            engine.abort_requests(added)
            for request_id in added:
                owners.pop(request_id, None)
            self._resolve(job, exc)
