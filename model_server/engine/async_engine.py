"""The asynchronous engine the HTTP layer talks to: `EngineClient` and its thread-backed `AsyncLLM`.

Threads and ownership (the invariants everything below relies on):
  - The engine thread owns the `LLMEngine` (scheduler, KV cache, model runner, output processor)
    and the `StatsTracker`: nothing else touches them. It loads the model, warms it up, then loops
    drain commands -> step -> hand outputs to the event loop -> record stats.
  - The event loop owns `_collectors` (one `RequestOutputCollector` per live request) and the
    futures that answer `add_request`. The engine thread reaches them only through
    `loop.call_soon_threadsafe`, so callbacks run in the order the thread posted them: a request's
    "added" answer always comes before its first output.
  - The event loop reaches the engine only through `_commands` (a thread-safe FIFO), so an abort
    queued after an add is always applied after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from model_server.config import EngineConfig
from model_server.engine.allocator import HeapTrimmer
from model_server.engine.outputs import RequestOutput
from model_server.engine.stats import IterationStats, StatLogger, record_cache_config
from model_server.lora.request import LoRARequest
from model_server.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class EnginePhase(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    # Shutting down: in-flight requests finish, new ones are refused.
    DRAINING = "draining"
    STOPPED = "stopped"
    ERROR = "error"


# Phases a shutdown turns into DRAINING.
_SERVING_PHASES = (EnginePhase.LOADING, EnginePhase.WARMING_UP, EnginePhase.READY)


class EngineNotReadyError(RuntimeError):
    """The engine cannot take requests now (loading, warming up, draining, stopped)."""


class EngineDeadError(RuntimeError):
    """The engine thread crashed; every pending and future request fails with this."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown drain timeout)."""


class EngineDrainingError(EngineNotReadyError):
    """The server is shutting down: in-flight requests finish, new ones are refused."""


class EngineOverloadedError(EngineNotReadyError):
    """More requests wait for the engine than `max_waiting_requests`: try again later."""


@dataclass(slots=True, frozen=True, eq=False)
class Admission:
    """The waiting slots `admit` holds for one HTTP request's engine requests."""

    request_ids: tuple[str, ...]


class EngineClient(ABC):
    """What the HTTP layer needs from an engine. Every method runs on the event loop."""

    # Told about every engine step (see engine/stats.py); append before start().
    stat_loggers: list[StatLogger]
    # Backpressure: `admit` and `generate` refuse requests (EngineOverloadedError) that would
    # make more than this many engine requests wait to be scheduled; 0 means no limit.
    max_waiting_requests: int = 0

    @property
    @abstractmethod
    def phase(self) -> EnginePhase: ...

    @property
    @abstractmethod
    def error_message(self) -> str | None:
        """Why the phase is ERROR (None otherwise)."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The HF tokenizer once the model is loaded; None before (or if the model has none)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int | None:
        """The context length once the model is loaded; None before."""

    @property
    def quantization(self) -> str | None:
        """The weights' quantization once the model is loaded ("gptq w4 g128", "int8"); None
        for float weights or before."""
        return None

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache's dtype once it is allocated (`--kv-cache-dtype` resolved: "bfloat16",
        "int8", "fp8_e4m3", ...); None before."""
        return None

    @property
    def is_ready(self) -> bool:
        return self.phase is EnginePhase.READY

    def check_ready(self) -> None:
        """Raise what `generate` would for an engine that cannot serve now."""
        phase = self.phase
        if phase is EnginePhase.ERROR:
            raise EngineDeadError(f"the engine failed: {self.error_message}")
        if phase is EnginePhase.DRAINING:
            raise EngineDrainingError("the server is shutting down")
        if phase is not EnginePhase.READY:
            raise EngineNotReadyError(f"the model is not ready yet (phase: {phase.value})")

    @abstractmethod
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs until one has `finished` (with the LoRA adapter
        `lora_request`, None: the base model).

        Raises before any output: ValueError for a request that can never run (the engine's
        message), EngineNotReadyError, EngineDeadError. When the consumer stops iterating
        (cancelled, closed, client gone), the request is aborted in the engine.
        """

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter (ValueError with the reason) so requests may use it."""
        raise ValueError("this engine serves no LoRA adapters")

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the engine's memory; whether it held it."""
        raise ValueError("this engine serves no LoRA adapters")

    @abstractmethod
    def admit(self, request_ids: Sequence[str]) -> Admission:
        """Hold a waiting slot for each of `request_ids` (one HTTP request's engine requests) at
        once, or raise and hold none: ValueError for an id in use or for more ids than
        `max_waiting_requests` could ever hold, EngineOverloadedError while the queue lacks room
        for all of them, and what `check_ready` raises. `generate` of an admitted id takes its
        slot without a check of its own; `release` drops the slots no `generate` took."""

    @abstractmethod
    def release(self, admission: Admission) -> None:
        """Drop the slots of `admission` that no `generate` took (it failed or never ran)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def wait_until_failed(self) -> str:
        """Return (with the error message) once the engine has died; may never return."""

    @abstractmethod
    async def start(self) -> None:
        """Begin loading in the background; returns at once (watch `phase`)."""

    @abstractmethod
    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (safe to call from a signal handler)."""

    @abstractmethod
    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `drain_timeout` seconds, abort
        the rest, stop the engine."""


class RequestOutputCollector:
    """Single-consumer mailbox for one request (event loop only).

    A slow consumer never makes outputs pile up: a new output is merged into the one not yet
    taken (cumulative fields from the newer one, deltas concatenated), like vLLM's collector.
    """

    __slots__ = ("_item", "_ready", "added")

    def __init__(self, added: asyncio.Future[None]) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        # Resolved when the engine accepted the request (or rejected it with an exception).
        self.added = added

    def put(self, item: RequestOutput | BaseException) -> None:
        prev = self._item
        if isinstance(item, RequestOutput) and isinstance(prev, RequestOutput):
            _merge_deltas(prev, item)
        if not isinstance(prev, BaseException):  # an error, once there, stays
            self._item = item
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if not self.added.done():
            self.added.set_exception(error)
        self.put(error)

    def get_nowait(self) -> RequestOutput | None:
        item = self._item
        if item is None:
            return None
        self._item = None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> RequestOutput:
        while (item := self.get_nowait()) is None:
            await self._ready.wait()
        return item


def _merge_deltas(older: RequestOutput, newer: RequestOutput) -> None:
    """Prepend `older`'s deltas to `newer`'s (both carry all n samples, in index order)."""
    for old, new in zip(older.outputs, newer.outputs, strict=True):
        new.text_delta = old.text_delta + new.text_delta
        new.token_ids_delta = old.token_ids_delta + new.token_ids_delta
        if old.logprobs_delta is not None and new.logprobs_delta is not None:
            new.logprobs_delta = old.logprobs_delta + new.logprobs_delta


# ------------------------------------------------------------------- commands to the engine


@dataclass(slots=True)
class _AddRequest:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float
    collector: RequestOutputCollector
    # The prompt's tokens when tokenized off the engine thread (None: the engine tokenizes).
    prompt_token_ids: list[int] | None = None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Call:
    """Run `fn` on the engine thread between steps (adapters' loading and unloading); its
    result or exception goes to `future` on the event loop."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def run(self) -> None:
        try:
            result, error = self.fn(), None
        except Exception as exc:  # the caller's to answer (ValueError: a bad adapter)
            result, error = None, exc
        self.loop.call_soon_threadsafe(self.resolve, result, error)

    def resolve(self, result: Any, error: BaseException | None) -> None:
        if self.future.done():
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


@dataclass(slots=True)
class _AbortRequests:
    request_ids: list[str]


@dataclass(slots=True)
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


_Command = _AddRequest | _AbortRequests | _Stop | _Call


class AsyncLLM(EngineClient):
    """The engine in a background thread, behind the `EngineClient` interface.

    `stat_loggers` get `record(SchedulerStats, IterationStats)` after every engine iteration that
    did something (a step, or adds/aborts), on the engine thread.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        skip_warmup: bool = False,
        stat_loggers: Iterable[StatLogger] = (),
        engine_factory: Callable[[EngineConfig], Any] | None = None,
    ) -> None:
        self.config = config
        self.skip_warmup = skip_warmup
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self._engine_factory = engine_factory
        self._engine: Any = None  # LLMEngine, set by the engine thread once loaded
        self._tokenizer: Any = None
        self._max_model_len: int | None = None
        self._quantization: str | None = None
        self._kv_cache_dtype: str | None = None
        self._phase = EnginePhase.LOADING
        self._error: str | None = None
        self._accepting = True
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._collectors: dict[str, RequestOutputCollector] = {}
        # Ids admitted by `admit` whose `generate` has not registered yet: they count as waiting,
        # so another request cannot take their slots in between.
        self._admitted: dict[str, Admission] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: asyncio.Event | None = None
        self._phase_changed: asyncio.Event | None = None
        self._logged_logger_errors: set[int] = set()
        # Engine requests the scheduler runs, as of the last iteration (written by the engine
        # thread, read by the loop: a plain int, so no lock).
        self._num_running = 0

    # ---------------------------------------------------------------- EngineClient: state

    @property
    def phase(self) -> EnginePhase:
        # Derived, not stored: the engine thread may move LOADING -> READY while the loop
        # begins a shutdown, and the answer must still be DRAINING.
        if not self._accepting and self._phase in _SERVING_PHASES:
            return EnginePhase.DRAINING
        return self._phase

    @property
    def error_message(self) -> str | None:
        return self._error

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    @property
    def quantization(self) -> str | None:
        return self._quantization

    @property
    def kv_cache_dtype(self) -> str | None:
        return self._kv_cache_dtype

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._collectors)

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests accepted but not running: the live ones less those the scheduler ran
        at its last iteration. Requests added since then count as waiting, which they are until
        the next step schedules them; so do those admitted and not yet added."""
        return max(0, len(self._collectors) - self._num_running) + len(self._admitted)

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait for READY; raises EngineDeadError if loading fails, TimeoutError on timeout."""
        assert self._phase_changed is not None, "call start() first"

        async def _wait() -> None:
            while self._phase is not EnginePhase.READY:
                self._raise_if_dead()
                self._phase_changed.clear()
                await self._phase_changed.wait()

        await asyncio.wait_for(_wait(), timeout)

    async def wait_until_failed(self) -> str:
        """Returns the error message once the engine thread has died."""
        assert self._failed is not None, "call start() first"
        await self._failed.wait()
        return self._error or "engine failed"

    # ------------------------------------------------------------ EngineClient: lifecycle

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._failed = asyncio.Event()
        self._phase_changed = asyncio.Event()
        # Daemon: a model load that cannot be interrupted must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="wick-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        self._accepting = False

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self.begin_shutdown()
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while self._collectors and time.monotonic() < deadline and self._thread_alive():
            await asyncio.sleep(0.05)
        if self._collectors:
            logger.warning(
                "drain timeout: aborting %d unfinished request(s)", len(self._collectors)
            )
            self._commands.put(_AbortRequests(list(self._collectors)))
            for collector in self._collectors.values():
                collector.fail(RequestAbortedError("the server is shutting down"))
        if self._thread_alive():
            stop = _Stop()
            self._commands.put(stop)
            # The thread may be busy loading the model, which cannot be interrupted: give it a
            # bounded time, then leave the daemon thread behind.
            await asyncio.to_thread(stop.done.wait, 10.0)
            # Then the thread's last frees: none may run while the interpreter exits.
            thread = self._thread
            if thread is not None and stop.done.is_set():
                await asyncio.to_thread(thread.join, 10.0)
        if self._phase is not EnginePhase.ERROR:
            self._set_phase(EnginePhase.STOPPED)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------- EngineClient: requests

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        # Check and register with no await in between: a crash or shutdown that the loop has
        # not heard of yet will still fail this collector (see _fail_all / shutdown).
        self._check_accepting(request_id)
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_outputs is not None:
            # Compiled (and cached) on a worker thread, never in an engine step; an
            # uncompilable grammar raises StructuredOutputError (a ValueError) here.
            manager = getattr(self._engine, "structured_output", None)
            if manager is not None:
                await asyncio.to_thread(manager.compile, params.structured_outputs)
            self._check_accepting(request_id)  # the engine may have failed or begun draining
            if request_id in self._collectors:
                raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = None
        if isinstance(prompt, str) and getattr(self._engine, "tokenize", None) is not None:
            # On a worker thread, never in an engine step: a request's prompts may hold tens of
            # MB of text (up to --max-request-body-size), seconds of tokenizing that would stall
            # every running request.
            prompt_token_ids = await asyncio.to_thread(self._tokenize, prompt)
            self._check_accepting(request_id)
            if request_id in self._collectors:
                raise ValueError(f"request id {request_id!r} is already in use")
        assert self._loop is not None
        collector = RequestOutputCollector(self._loop.create_future())
        self._collectors[request_id] = collector
        self._admitted.pop(request_id, None)  # its slot is the collector's now
        self._commands.put(
            _AddRequest(
                request_id,
                prompt,
                params,
                time.monotonic(),
                collector,
                prompt_token_ids,
                lora_request,
            )
        )
        finished = False
        try:
            await collector.added
            while not finished:
                # get_nowait first: no task switch when an output is already waiting.
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        except (ValueError, EngineDeadError, RequestAbortedError):
            finished = True  # nothing left in the engine to abort
            raise
        finally:
            self._collectors.pop(request_id, None)
            if not finished:  # cancelled, closed early or client gone: free its KV blocks now
                self._commands.put(_AbortRequests([request_id]))

    def _tokenize(self, prompt: str) -> list[int]:
        """The engine's own tokenizing (thread-safe: the tokenizer only), on a worker thread."""
        try:
            return self._engine.tokenize(prompt)
        except ValueError:
            raise
        except Exception as exc:  # the tokenizer's own errors are about the text
            raise ValueError(f"the prompt could not be tokenized: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        self._commands.put(_AbortRequests([request_id]))

    async def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._commands.put(_Call(fn, loop, future))
        return await future

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self._on_engine_thread(lambda: self._engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._on_engine_thread(lambda: self._engine.remove_lora(lora_int_id))

    def admit(self, request_ids: Sequence[str]) -> Admission:
        for request_id in request_ids:
            if request_id in self._collectors or request_id in self._admitted:
                raise ValueError(f"request id {request_id!r} is already in use")
        self._check_accepting(count=len(request_ids))
        admission = Admission(tuple(request_ids))
        self._admitted.update(dict.fromkeys(admission.request_ids, admission))
        return admission

    def release(self, admission: Admission) -> None:
        for request_id in admission.request_ids:
            # Only its own: the id may be another request's by now (a client reusing its id).
            if self._admitted.get(request_id) is admission:
                del self._admitted[request_id]

    def _check_accepting(self, request_id: str | None = None, count: int = 1) -> None:
        """Raise unless `count` more engine requests may wait now; an admitted `request_id`
        holds its slot already."""
        self._raise_if_dead()
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down")
        self.check_ready()
        if request_id is None or request_id not in self._admitted:
            self._check_room(count)

    def _check_room(self, count: int) -> None:
        limit = self.max_waiting_requests
        if limit <= 0:
            return
        if count > limit:
            raise ValueError(
                f"this request makes {count} engine requests (one per prompt), more than the "
                f"{limit} that may wait at once (--max-waiting-requests {limit}): send at most "
                f"{limit} prompts per request"
            )
        waiting = self.num_waiting_requests
        if waiting + count > limit:
            adding = f" and this request adds {count}" if count > 1 else ""
            raise EngineOverloadedError(
                f"the server is overloaded: {waiting} requests are already waiting{adding} "
                f"(--max-waiting-requests {limit}); retry later"
            )

    def _raise_if_dead(self) -> None:
        if self._phase is EnginePhase.ERROR:
            raise EngineDeadError(f"the engine failed: {self._error}")

    # ------------------------------------------------------------ event-loop callbacks

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the event loop (from the engine thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(fn, *args)

    def _set_phase(self, phase: EnginePhase) -> None:
        if self._phase is EnginePhase.ERROR:
            return  # terminal
        self._phase = phase
        if self._phase_changed is not None:
            self._post(self._phase_changed.set)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:  # None: its consumer left; the abort is on its way
                collector.put(out)

    @staticmethod
    def _resolve_added(collector: RequestOutputCollector, error: BaseException | None) -> None:
        if collector.added.done():
            return
        if error is None:
            collector.added.set_result(None)
        else:
            collector.added.set_exception(error)

    def _fail_all(self, message: str) -> None:
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"the engine failed: {message}"))
        if self._failed is not None:
            self._failed.set()
        if self._phase_changed is not None:
            self._phase_changed.set()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._load()
            if self.skip_warmup:
                logger.info("warmup skipped")
            else:
                self._set_phase(EnginePhase.WARMING_UP)
                self._warmup()
            self._tracker.reset_baseline()
            self._set_phase(EnginePhase.READY)
            logger.info("engine ready")
            self._serve()
            return
        except BaseException as exc:  # the thread must never die silently: fail everyone
            if self._phase is EnginePhase.LOADING and isinstance(exc, ValueError | OSError):
                logger.error("could not load the model: %s", exc)  # the message says it all
            else:
                logger.exception("engine thread failed")
            if self._phase is not EnginePhase.ERROR:  # a worker death reported it first
                self._error = f"{type(exc).__name__}: {exc}"
                self._phase = EnginePhase.ERROR  # before posting: generate() checks it
                self._post(self._fail_all, self._error)
        # Out of the except block, the traceback and what only it holds (a half-built engine:
        # the model's tensors) are freed here, before shutdown() hears back. Freed after, on
        # this daemon thread while the interpreter exits, a tensor's deallocator re-taking the
        # GIL killed the thread mid C++ frame: SIGABRT, "terminate called without an active
        # exception" (seen on 2 of 6 starts with a too-small --kv-cache-memory).
        self._drain_stop_commands()

    def _on_engine_failure(self, message: str) -> None:
        """From the executor's monitor thread: a tensor-parallel worker died. Fail now, even
        while the engine thread is idle or blocked in a collective."""
        if self._phase is EnginePhase.ERROR:
            return
        self._error = message
        self._phase = EnginePhase.ERROR
        self._post(self._fail_all, message)

    def _load(self) -> None:
        from model_server.engine.stats_tracker import StatsTracker

        start = time.perf_counter()
        if self._engine_factory is not None:
            engine = self._engine_factory(self.config)
        else:
            from model_server.engine.llm_engine import LLMEngine

            engine = LLMEngine(self.config)
        self._engine = engine
        add_failure_callback = getattr(engine, "add_failure_callback", None)
        if add_failure_callback is not None:  # test doubles may have none
            add_failure_callback(self._on_engine_failure)
        self._tracker = StatsTracker(engine.scheduler)
        self._tokenizer = engine.tokenizer
        self._max_model_len = engine.max_model_len
        self._quantization = getattr(engine, "quantization", None)  # test doubles may have none
        for stat_logger in self.stat_loggers:
            set_model_info = getattr(stat_logger, "set_model_info", None)
            if set_model_info is not None:
                set_model_info(self._quantization)
        info = getattr(engine, "cache_config_info", None)  # test doubles may have none
        if info is not None:
            self._kv_cache_dtype = info.cache_dtype
            record_cache_config(self.stat_loggers, info)
        logger.info("model loaded in %.1fs", time.perf_counter() - start)

    def _warmup(self) -> None:
        """Run dummy requests through prefill and decode (greedy and sampled paths), so the
        first real request pays no one-time costs (allocator, kernels, lazy inits)."""
        engine = self._engine
        start = time.perf_counter()
        vocab = engine.vocab_size
        max_len = self._max_model_len or 64
        prompt_len = max(1, min(32, max_len - 4))
        prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]
        requests = {
            "warmup-greedy": SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
            "warmup-sampled": SamplingParams(
                max_tokens=3, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True, seed=0
            ),
        }
        for i, (request_id, params) in enumerate(requests.items()):
            engine.add_request(request_id, prompt[: prompt_len - i], params)
        while engine.has_unfinished_requests():
            engine.step()
        logger.info("warmup done in %.2fs", time.perf_counter() - start)

    def _serve(self) -> None:
        engine = self._engine
        trimmer = HeapTrimmer()
        while True:
            idle = not engine.has_unfinished_requests()
            trimmer.maybe_trim(idle)
            # Idle, it still wakes for the next trim: requests the HTTP layer refused (over a
            # limit) freed memory without ever reaching the engine.
            commands = self._next_commands(
                block=idle, timeout=trimmer.seconds_until_due(idle) if idle else None
            )
            if idle and not commands:
                continue
            stats = IterationStats()
            aborts: dict[str, None] = {}  # ordered set: applied in one pass (see _abort)
            for command in commands:
                if isinstance(command, _Stop):
                    self._abort(aborts, stats)
                    self._stop(command)
                    return
                if isinstance(command, _AbortRequests):
                    aborts.update(dict.fromkeys(command.request_ids))
                    continue
                if isinstance(command, _Call):
                    command.run()
                    continue
                if command.request_id in aborts:
                    # The id is reused after its abort was queued: that abort goes first.
                    self._abort(aborts, stats)
                    aborts = {}
                self._apply(command, stats)
            self._abort(aborts, stats)
            if engine.has_unfinished_requests():
                step_start = time.monotonic()
                outputs = engine.step()
                now = time.monotonic()
                if outputs:
                    self._post(self._dispatch, outputs)
                self._tracker.update(outputs, step_start, now, stats)
            self._num_running = self._tracker.num_running()
            self._record(stats)

    def _next_commands(self, block: bool, timeout: float | None = None) -> list[_Command]:
        """What the queue holds; with `block`, waits for one first (up to `timeout` seconds,
        then returns nothing)."""
        commands: list[_Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _abort(self, request_ids: Iterable[str], stats: IterationStats) -> None:
        """Every abort of one drain of the command queue in one engine call: a client that drops
        a 100,000-prompt request queues 100,000 aborts, and one scheduler pass per abort would
        be O(n^2)."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        self._engine.abort_requests(request_ids)
        now = time.monotonic()
        for request_id in request_ids:
            self._tracker.aborted(request_id, now, stats)

    def _apply(self, command: _AddRequest, stats: IterationStats) -> None:
        engine = self._engine
        try:
            # Only a LoRA request passes the keyword (engines of tests may not take it).
            lora = {} if command.lora_request is None else {"lora_request": command.lora_request}
            engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                prompt_token_ids=command.prompt_token_ids,
                **lora,
            )
        except Exception as exc:
            # The caller's problem, not the engine's: answer it and keep serving the others.
            if not isinstance(exc, ValueError):
                logger.exception("add_request(%s) failed", command.request_id)
                engine.abort_requests([command.request_id])
            self._post(self._resolve_added, command.collector, exc)
            return
        self._tracker.add(
            command.request_id, command.params.n, command.arrival_time, command.params.max_tokens
        )
        self._post(self._resolve_added, command.collector, None)

    def _record(self, stats: IterationStats) -> None:
        if not self.stat_loggers:
            return
        scheduler_stats = self._tracker.scheduler_stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, stats)
            except Exception:  # a broken logger must not take the engine down
                if id(stat_logger) not in self._logged_logger_errors:
                    self._logged_logger_errors.add(id(stat_logger))
                    logger.exception("stat logger %r failed", stat_logger)

    def _stop(self, command: _Stop) -> None:
        stats = IterationStats()
        self._abort(self._tracker.live_request_ids(), stats)
        self._record(stats)
        self._shutdown_engine()
        command.done.set()

    def _shutdown_engine(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    def _drain_stop_commands(self) -> None:
        """After a crash, keep answering the command queue so shutdown() never waits for us."""
        while True:
            command = self._commands.get()
            if isinstance(command, _Stop):
                self._shutdown_engine()
                command.done.set()
                return
            if isinstance(command, _Call):
                error = EngineDeadError(self._error)
                command.loop.call_soon_threadsafe(command.resolve, None, error)
                continue
            if isinstance(command, _AddRequest):
                self._post(self._resolve_added, command.collector, EngineDeadError(self._error))
