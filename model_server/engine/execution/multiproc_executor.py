"""Tensor parallelism over processes: rank 0 (this process) schedules, workers follow.

Each step rank 0 packs the scheduled chunks into one broadcast (distributed/step_channel.py),
then every rank builds the same inputs and runs the same forward; the LM head gathers the
logits on rank 0, which alone samples. Workers keep no request state and never sample, so a
step needs no reply from them and sampling state (seeded generators) lives in one place.

Failure handling: a monitor thread waits on the local workers' process sentinels. When one dies
the executor records why, kills the other workers and tells its failure callbacks (the async
engine turns `/health` to 503 and fails every request); a step in flight fails at once because
gloo/nccl see the closed connection, and any later step raises. Collectives inside a step have
a finite timeout (parallel_state.COLLECTIVE_TIMEOUT). Workers exit when this process does: they
watch their parent's sentinel, and `shutdown()` (also run at exit) tells them to stop.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable

from model_server.config import EngineConfig
from model_server.distributed.parallel_state import (
    cpu_all_reduce_min,
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
)
from model_server.distributed.rendezvous import rendezvous_from_env
from model_server.distributed.step_channel import MessageKind, StepChannel
from model_server.engine.core.scheduler import SchedulerOutput
from model_server.engine.execution.executor import Executor, FailureCallback
from model_server.engine.execution.model_preparation import prepare_model
from model_server.engine.execution.model_runner import ModelRunner
from model_server.engine.execution.worker import WorkerSpec, check_device_ids, run_worker
from model_server.engine.outputs import ModelRunnerOutput
from model_server.loader import ModelSource
from model_server.models import check_tensor_parallel
from model_server.platforms import Platform

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot step any more."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, platform: Platform) -> None:
        world_size = config.tensor_parallel_size
        # Everything that can be checked before any process starts.
        check_tensor_parallel(source.hf_config, world_size)
        rdzv = rendezvous_from_env()
        if rdzv.node_rank != 0:
            raise ValueError(
                f"NODE_RANK={rdzv.node_rank}: nodes other than 0 run `python -m model_server "
                "worker` with the same model flags"
            )
        local_world_size = rdzv.local_world_size(world_size)
        check_device_ids(config.device_ids, local_world_size)
        self.platform = platform
        self.world_size = world_size
        self._failure: str | None = None
        self._callbacks: list[FailureCallback] = []
        self._closed = False
        self._lock = threading.Lock()  # one issuer of collectives at a time (step vs shutdown)
        self._wake_r, self._wake_w = os.pipe()  # wakes the monitor on shutdown
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[multiprocessing.process.BaseProcess] = []
        log_level = logging.getLogger().getEffectiveLevel()
        for local_rank in range(1, local_world_size):
            spec = WorkerSpec(
                config=config,
                rank=local_rank,
                local_rank=local_rank,
                local_world_size=local_world_size,
                init_method=rdzv.init_method,
                log_level=log_level,
            )
            proc = ctx.Process(
                target=run_worker, args=(spec,), name=f"wick-tp-worker-{local_rank}", daemon=True
            )
            proc.start()
            self.workers.append(proc)
        atexit.register(self.shutdown)
        self._monitor = threading.Thread(target=self._watch_workers, name="wick-tp-monitor")
        self._monitor.daemon = True
        self._monitor.start()
        try:
            platform.select_device(0, config.device_ids)
            platform.prepare(config.num_threads, local_world_size)
            platform.init_distributed_backend()
            init_tensor_parallel(
                rank=0,
                world_size=world_size,
                local_rank=0,
                local_world_size=local_world_size,
                backend=platform.dist_backend,
                init_method=rdzv.init_method,
            )
            self.channel = StepChannel(get_tp_group().cpu_group)
            self.model_runner = ModelRunner(prepare_model(config, source, platform), platform)
        except BaseException as exc:
            self.shutdown()
            raise self._explain(exc) from exc
        logger.info(
            "tensor parallelism: %d ranks (%d on this node, %d worker processes)",
            world_size,
            local_world_size,
            len(self.workers),
        )

    # ---- steps ------------------------------------------------------------------------------

    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        runner = self.model_runner
        step = runner.prepare_step(scheduler_output)
        with self._lock:
            self._check_alive()
            try:
                self.channel.send(MessageKind.EXECUTE, step.pack(runner.block_size))
                out = runner.execute_step(step)
            except RuntimeError as exc:
                raise self._explain(exc) from exc
        return runner.sample(scheduler_output.scheduled_requests, out)

    def determine_num_blocks(self, kv_cache_memory: int | None) -> int:
        with self._lock:
            try:
                # Every worker does the same after loading (worker.py): the profile forward,
                # if any, and this reduction are collectives.
                local = self.model_runner.local_num_blocks(kv_cache_memory)
                return cpu_all_reduce_min(local)
            except RuntimeError as exc:
                raise self._explain(exc) from exc

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)

    # ---- failures ---------------------------------------------------------------------------

    def add_failure_callback(self, callback: FailureCallback) -> None:
        self._callbacks.append(callback)
        if self._failure is not None:
            callback(self._failure)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        if self._closed:
            raise WorkerDiedError("the tensor-parallel executor is shut down")

    def _explain(self, exc: BaseException) -> BaseException:
        """A collective that failed because a worker died says so."""
        if self._failure is not None and not isinstance(exc, WorkerDiedError):
            return WorkerDiedError(f"{self._failure} ({exc})")
        return exc

    def _watch_workers(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.workers}
        ready = multiprocessing.connection.wait([*by_sentinel, self._wake_r])
        if self._closed:
            return
        proc = next(by_sentinel[s] for s in ready if s in by_sentinel)
        proc.join(0)
        self._fail(
            f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        )

    def _fail(self, message: str) -> None:
        if self._failure is not None:
            return
        self._failure = message
        logger.error("%s: the engine cannot continue", message)
        self._stop_workers(graceful=False)
        for callback in list(self._callbacks):
            _call_safely(callback, message)

    # ---- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (a SHUTDOWN message, then terminate/kill stragglers), leave the
        process group. Idempotent; also registered with atexit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        os.write(self._wake_w, b"x")
        self._stop_workers(graceful=self._failure is None)
        if self._monitor.is_alive():
            self._monitor.join(_JOIN_TIMEOUT_S)
        if get_tp_group() is not None:
            destroy_tensor_parallel()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _stop_workers(self, graceful: bool) -> None:
        channel = getattr(self, "channel", None)
        if graceful and channel is not None and self._lock.acquire(timeout=_JOIN_TIMEOUT_S):
            try:
                channel.send(MessageKind.SHUTDOWN, [])
            except RuntimeError:
                pass  # a worker is already gone: terminate below
            finally:
                self._lock.release()
            for proc in self.workers:
                proc.join(_JOIN_TIMEOUT_S)
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
        for proc in self.workers:
            proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(_JOIN_TIMEOUT_S)


def _call_safely(callback: Callable[[str], None], message: str) -> None:
    try:
        callback(message)
    except Exception:
        logger.exception("failure callback %r raised", callback)
