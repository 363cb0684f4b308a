"""Executors: how the engine core's model steps reach the device(s).

`UniProcExecutor` (tensor_parallel_size 1) calls the model runner in this process: no
collectives, no extra processes, no copies. `MultiprocExecutor` (multiproc_executor.py) runs
rank 0 here and ranks 1..N-1 in worker processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from model_server.config import EngineConfig
from model_server.engine.core.scheduler import SchedulerOutput
from model_server.engine.execution.model_preparation import prepare_model
from model_server.engine.execution.model_runner import ModelRunner
from model_server.engine.outputs import ModelRunnerOutput
from model_server.loader import ModelSource
from model_server.platforms import Platform

FailureCallback = Callable[[str], None]


class Executor(ABC):
    """Owns rank 0's `model_runner`; everything that talks to other ranks is behind it."""

    model_runner: ModelRunner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Drop the state of requests finished since the last step, then run the scheduled
        requests (no model call when there are none)."""
        self.model_runner.release(scheduler_output.finished_request_ids)
        if not scheduler_output.scheduled_requests:
            return ModelRunnerOutput([], [])
        return self._execute_step(scheduler_output)

    @abstractmethod
    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def determine_num_blocks(self, kv_cache_memory: int | None) -> int:
        """KV blocks every rank can hold (the same count everywhere: the scheduler's). With no
        `kv_cache_memory`, every rank may first profile a forward (ModelRunner.local_num_blocks).
        """

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def add_failure_callback(self, callback: FailureCallback) -> None:
        """`callback(message)` runs (on another thread) if a worker dies; never with one rank."""
        return None

    def shutdown(self) -> None:
        return None


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, platform: Platform) -> None:
        self.platform = platform
        platform.select_device(0, config.device_ids)
        platform.prepare(config.num_threads)
        self.model_runner = ModelRunner(prepare_model(config, source, platform), platform)

    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def determine_num_blocks(self, kv_cache_memory: int | None) -> int:
        return self.model_runner.local_num_blocks(kv_cache_memory)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(num_blocks)
