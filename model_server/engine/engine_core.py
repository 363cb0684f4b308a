"""The synchronous engine core: schedule -> execute -> update, one step at a time. No asyncio."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from model_server.config import EngineConfig
from model_server.engine.executor import create_executor
from model_server.engine.kv_cache_manager import KVCacheManager
from model_server.engine.model_runner import TokenLogprobs
from model_server.engine.request import Request, RequestStatus
from model_server.engine.scheduler import Scheduler, SchedulerConfig
from model_server.engine.worker import resolve_max_model_len
from model_server.loader import ModelSource, load_model_source
from model_server.platforms import get_platform

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        config.validate()
        self.config = config
        self.platform = get_platform(config.device)
        self.source = source or load_model_source(config.model, config.load_format)
        hf_config = self.source.hf_config
        model_max_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d",
                config.max_model_len,
                model_max_len,
            )
        # Resolved after the workers start, so that they too can tell a given length from the
        # model's (worker.run_worker): only the model's is fitted to the KV cache.
        max_model_len_given = config.max_model_len is not None
        self.executor = create_executor(config, self.source, self.platform)
        resolve_max_model_len(config, hf_config)
        try:
            self._init_kv_cache(config, max_model_len_given)
        except BaseException:
            self.executor.shutdown()
            raise
        self.model_runner = self.executor.model_runner
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config, config.max_model_len),
            self.kv_cache_manager,
        )

    def _init_kv_cache(self, config: EngineConfig, max_model_len_given: bool) -> None:
        # Without --kv-cache-memory every rank may profile a forward here (memory_profiler.py).
        self.num_blocks = self.executor.determine_num_blocks(config.kv_cache_memory)
        runner = self.executor.model_runner
        bytes_per_block = runner.bytes_per_block()
        # Checked once the count is the smallest over the ranks, so that no rank raises alone
        # while the others wait in the reduction.
        runner.check_num_blocks(self.num_blocks, max_model_len_given)
        if self.num_blocks < 2:
            budget = config.kv_cache_memory or self.num_blocks * bytes_per_block
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds fewer than 2 blocks of "
                f"{bytes_per_block} bytes; raise --kv-cache-memory"
            )
        self._fit_max_model_len(config, max_model_len_given)
        self.executor.initialize_kv_cache(self.num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB per rank)",
            self.num_blocks,
            config.block_size,
            self.num_blocks * config.block_size,
            self.num_blocks * bytes_per_block / 1024**3,
        )

    def _fit_max_model_len(self, config: EngineConfig, max_model_len_given: bool) -> None:
        """A context the KV cache cannot hold even for one sequence is lowered to what it holds
        when the context length came from the model, so that requests without `max_tokens` (which
        run to the end of the context) are served instead of refused. A `--max-model-len` the
        user gave is kept: a profiled budget too small for it has already raised
        (check_num_blocks); with a given `--kv-cache-memory`, longer requests are refused one
        by one with the cache's numbers (Scheduler.add_request)."""
        capacity = self.num_blocks * config.block_size
        assert config.max_model_len is not None  # resolved in __init__
        if capacity >= config.max_model_len:
            return
        if max_model_len_given:
            logger.warning(
                "the KV cache holds %d tokens, fewer than --max-model-len %d: longer requests "
                "will be refused; raise --kv-cache-memory to serve the whole context",
                capacity,
                config.max_model_len,
            )
            return
        logger.warning(
            "max_model_len lowered from the model's %d to %d tokens, what the KV cache holds; "
            "give the cache more memory (--kv-cache-memory, --gpu-memory-utilization) for a "
            "longer context",
            config.max_model_len,
            capacity,
        )
        config.max_model_len = capacity

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(message)` runs on another thread if a tensor-parallel worker dies."""
        self.executor.add_failure_callback(callback)

    def shutdown(self) -> None:
        """Stop the worker processes (if any). The core cannot step afterwards."""
        self.executor.shutdown()

    @property
    def tokenizer(self):
        return self.source.tokenizer

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
        vocab = self.model_runner.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is out of range for the vocabulary (0-{vocab - 1})"
            )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish requests whose stop string was found by the detokenizer."""
        self._finish(request_ids, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        for request in self.scheduler.finish_requests(request_ids, status):
            self.model_runner.release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled_requests:
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        logprobs_by_id = {
            r.request_id: lp
            for r, lp in zip(
                scheduler_output.scheduled_requests, runner_output.logprobs, strict=True
            )
            if lp is not None
        }
        updated = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids
        )
        sampled_ids = _sampled_ids(scheduler_output, runner_output)
        outputs = []
        for request in updated:
            finish_reason = RequestStatus.finish_reason(request.status)
            if finish_reason is not None:
                self.model_runner.release(request)
            lp = logprobs_by_id.get(request.request_id)
            sampled = request.request_id in sampled_ids
            new_tokens = request.output_token_ids[-1:] if sampled else []
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=new_tokens,
                    new_logprobs=[lp] if lp is not None else None,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        return outputs


def _sampled_ids(scheduler_output, runner_output) -> set[str]:
    return {
        r.request_id
        for r, t in zip(
            scheduler_output.scheduled_requests, runner_output.sampled_token_ids, strict=True
        )
        if t is not None
    }
