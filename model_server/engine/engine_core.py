"""The synchronous engine core: schedule -> execute -> update, one step at a time. No asyncio."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from model_server.config import EngineConfig, KVEventsConfig
from model_server.engine.core.kv_cache_manager import KVCacheManager
from model_server.engine.core.kv_events import KVEventRecorder
from model_server.engine.core.request import Request, RequestStatus
from model_server.engine.core.scheduler import Scheduler, SchedulerConfig
from model_server.engine.execution.executor import Executor, UniProcExecutor
from model_server.engine.execution.multiproc_executor import MultiprocExecutor
from model_server.engine.outputs import EngineCoreOutput
from model_server.engine.stats import CacheConfigInfo
from model_server.loader import ModelSource, load_model_source
from model_server.lora.manager import LoRAModelManager
from model_server.lora.request import LoRARequest
from model_server.platforms import get_platform

if TYPE_CHECKING:
    from model_server.engine.kv_event_publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler (with its KV cache manager) and the executor.

    `config` is the configuration as resolved once at startup and never changed after: the
    model's context length in place of `max_model_len=None`, lowered to what the KV cache holds
    (see `_fit_max_model_len`); `num_blocks` is the cache's size.
    """

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        config.validate()
        self.platform = get_platform(config.device)
        if config.max_num_batched_tokens is None:
            config = self.platform.with_defaults(config)
            logger.info(
                "token budget per step: %d (the %s default; --max-num-batched-tokens)",
                config.max_num_batched_tokens,
                self.platform.name,
            )
        self.source = source or load_model_source(
            config.model, config.load_format, hf_overrides=config.hf_overrides
        )
        context_length = self.source.context_length
        if config.max_model_len is not None and config.max_model_len > context_length:
            # Refused, as vLLM does: positions past the model's are untrained, and the rotary
            # tables sized for them can take more memory than the machine has (--max-model-len
            # 99999999 was an OOM kill, not an error).
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's context length "
                f"(max_position_embeddings {context_length}); lower it, or raise the model's with "
                "--hf-overrides '{\"max_position_embeddings\": N}' if it was trained for more"
            )
        # Every rank gets the config as given and resolves the length itself (ModelRunner), so
        # that each tells a given length from the model's: only the model's is fitted to the cache.
        executor_class: type[Executor] = (
            UniProcExecutor if config.tensor_parallel_size == 1 else MultiprocExecutor
        )
        if config.distributed_executor_backend == "ray":
            from model_server.engine.execution.ray_executor import RayExecutor

            executor_class = RayExecutor
        self.executor: Executor = executor_class(config, self.source, self.platform)
        self.model_runner = self.executor.model_runner
        try:
            self.num_blocks = self._determine_num_blocks(config)
            max_model_len = self._fit_max_model_len(config)
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.config = dataclasses.replace(config, max_model_len=max_model_len)
        kv_dtype = self.model_runner.kv_dtype
        kv_bytes = self.model_runner.kv_cache_bytes(self.num_blocks)
        self.cache_config_info = CacheConfigInfo(
            block_size=config.block_size,
            num_gpu_blocks=self.num_blocks,
            cache_dtype=kv_dtype.name,
            kv_cache_bytes=kv_bytes,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB per rank, %s%s)",
            self.num_blocks,
            config.block_size,
            self.num_blocks * config.block_size,
            kv_bytes / 1024**3,
            kv_dtype.name,
            " codes + float32 scales per token and KV head" if kv_dtype.quantized else "",
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding=self.model_runner.sliding_window_spec(self.num_blocks),
        )
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(self.config, max_model_len), self.kv_cache_manager
        )
        self.kv_events: KVEventRecorder | None = None
        self.kv_event_publisher: ZmqEventPublisher | None = None
        self._start_kv_events(config)

    def _start_kv_events(self, config: EngineConfig) -> None:
        """With --kv-events-config: the manager reports to a recorder, each step publishes."""
        events_config = KVEventsConfig.parse(config.kv_events_config)
        if events_config is None:
            return
        from model_server.engine.kv_event_publisher import ZmqEventPublisher

        try:
            self.kv_event_publisher = ZmqEventPublisher(events_config)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_events = self.kv_cache_manager.kv_events = KVEventRecorder(config.block_size)
        self.kv_event_publisher.publish(self.kv_events.take_events())  # AllBlocksCleared first

    def _determine_num_blocks(self, config: EngineConfig) -> int:
        # Without --kv-cache-memory every rank may profile a forward here (memory_profiler.py).
        num_blocks = self.executor.determine_num_blocks(config.kv_cache_memory)
        # Checked once the count is the smallest over the ranks, so that no rank raises alone
        # while the others wait in the reduction.
        self.model_runner.check_num_blocks(num_blocks)
        if num_blocks < 2:
            bytes_per_block = self.model_runner.bytes_per_block()
            budget = config.kv_cache_memory or num_blocks * bytes_per_block
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds fewer than 2 blocks of "
                f"{bytes_per_block} bytes; raise --kv-cache-memory"
            )
        return num_blocks

    def _fit_max_model_len(self, config: EngineConfig) -> int:
        """The served context length. One the KV cache cannot hold even for one sequence is
        lowered to what it holds when it came from the model, so that requests without
        `max_tokens` (which run to the end of the context) are served instead of refused. A
        `--max-model-len` the user gave is kept: a profiled budget too small for it has already
        raised (check_num_blocks); with a given `--kv-cache-memory`, longer requests are refused
        one by one with the cache's numbers (Scheduler.add_request)."""
        max_model_len = self.model_runner.max_model_len
        capacity = self.num_blocks * config.block_size
        if capacity >= max_model_len:
            return max_model_len
        if config.max_model_len is not None:
            logger.warning(
                "the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                "will be refused; raise --kv-cache-memory to serve the whole context",
                capacity,
                max_model_len,
            )
            return max_model_len
        logger.warning(
            "max_model_len lowered from the model's %d to %d tokens, what the KV cache holds; "
            "give the cache more memory (--kv-cache-memory, --gpu-memory-utilization) for a "
            "longer context",
            max_model_len,
            capacity,
        )
        return capacity

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs on another thread if a tensor-parallel worker dies."""
        self.executor.add_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the worker processes (if any) and the KV event publisher. The core cannot step
        afterwards."""
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    @property
    def tokenizer(self):
        return self.source.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model_runner.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        tok = self.source.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            return int(tok.eos_token_id)
        eos = getattr(self.source.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            return eos[0] if eos else None
        return eos

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError when it can never be served."""
        vocab = self.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is out of range for the vocabulary (0-{vocab - 1})"
            )
        request.sampling_params.check_vocabulary(vocab)
        self.scheduler.add_request(request)

    # ---- LoRA adapters (--enable-lora; the runner's manager, one rank) -----------------------

    def _lora_manager(self) -> LoRAModelManager:
        manager = self.model_runner.lora_manager
        if manager is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return manager

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter's folder against the model (ValueError with the reason)."""
        self._lora_manager().add_adapter(lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError unless requests may use this adapter (LoRA on, the folder readable)."""
        self._lora_manager().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory and its device slot. Requests still running with
        it keep it: it is read again from its folder if they need it after this."""
        return self._lora_manager().remove_adapter(lora_int_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish requests whose stop string was found by the detokenizer."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.kv_event_publisher is not None and self.kv_events is not None:
            self.kv_event_publisher.publish(self.kv_events.take_events())
        return outputs
