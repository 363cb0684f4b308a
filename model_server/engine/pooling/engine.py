"""The synchronous pooling engine: schedule -> execute, one step at a time. No asyncio."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable

import torch

from model_server.config import EngineConfig
from model_server.engine.pooling.config import PoolerConfig, pooler_config
from model_server.engine.pooling.request import PoolingOutput, PoolingRequest
from model_server.engine.pooling.runner import PoolingRunner, build_pooling_model
from model_server.engine.pooling.scheduler import PoolingScheduler
from model_server.loader import ModelSource, hub, load_model_source
from model_server.loader.hf_loader import read_hf_config
from model_server.platforms import get_platform

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The step budget when --max-num-batched-tokens is unset (tokens, see scheduler.py).
POOLING_MAX_NUM_BATCHED_TOKENS = 8192
# Engine flags that belong to the paged KV cache, generation or the generative model's kernels:
# a pooling model keeps no KV cache, generates nothing and runs unquantized on one device (its
# linear layers planned as a decoder's: --cpu-linear-tuning and its budget apply), so asking
# for them (anything but their defaults) is refused rather than ignored. --cpu-isa and
# --cpu-flags are not among them: they configure the process (the native library a pooling
# model's kernels load too), and a WICK_CPU_ISA exported for a machine must not stop its
# embedding server.
_GENERATIVE_ONLY = (
    "quantization", "kv_cache_dtype", "tensor_parallel_size", "kv_cache_memory", "load_format",
    "block_size", "enable_prefix_caching", "enable_chunked_prefill", "attention_backend",
    "enforce_eager", "gguf_weights", "kv_events_config", "distributed_executor_backend",
    "speculative_config",
    "cpu_auto_dtype",
    "gguf_int8_dot", "gguf_weight_cache",
)  # fmt: skip


def _check_pooling_config(config: EngineConfig) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in _GENERATIVE_ONLY:
        if name in defaults and getattr(config, name) != defaults[name]:
            raise ValueError(
                f"--{name.replace('_', '-')} is not supported for pooling models (they keep no "
                "KV cache, generate nothing and run unquantized on one device)"
            )


def detect_pooler(model: str | None, revision: str | None = None) -> PoolerConfig | None:
    """The pooling setup of an HF folder (or its config.json, or a hub id: its config files are
    fetched), None for anything else (GGUF files, the embedded model: generative)."""
    if not model:
        return None
    path = os.path.expanduser(model.strip())
    if not os.path.exists(path) and hub.looks_like_hub_id(model.strip()):
        path = hub.download(model.strip(), revision, weights=False)
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    return pooler_config(path, read_hf_config(path))


class PoolingEngine:
    """Owns the pooling scheduler and runner. `max_model_len`: the longest input in tokens (the
    model's, or sentence-transformers' `max_seq_length`, or a smaller `--max-model-len`)."""

    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        config.validate()
        _check_pooling_config(config)
        self.platform = get_platform(config.device)
        self.source = source or load_model_source(config.model, hf_overrides=config.hf_overrides)
        pooler = pooler_config(self.source.path, self.source.hf_config)
        if pooler is None:
            raise ValueError(f"{self.source.path} is not a pooling model")
        self.pooler = pooler
        max_len = pooler.max_length
        if config.max_model_len is not None:
            if config.max_model_len > max_len:
                raise ValueError(
                    f"--max-model-len {config.max_model_len} exceeds the model's maximum input "
                    f"length ({max_len} tokens)"
                )
            max_len = config.max_model_len
        self.max_model_len = max_len
        # Unset, a bigger step than generation's: no decode waits behind a pooling step, and
        # bigger matmuls run faster (all-MiniLM at batch 32 on the Zen 5: 2x from 512 to 8192).
        budget = config.max_num_batched_tokens or max(
            self.platform.default_max_num_batched_tokens, POOLING_MAX_NUM_BATCHED_TOKENS
        )
        self.scheduler = PoolingScheduler(config.max_num_seqs, budget, max_len)
        dtype = self.platform.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
        self.dtype = dtype
        model = build_pooling_model(
            self.source, pooler, dtype, self.platform, config.kernel_options(),
            self.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        self.runner = PoolingRunner(model, pooler, self.platform.device)

    @property
    def tokenizer(self):
        return self.source.tokenizer

    def add_request(self, request: PoolingRequest) -> None:
        """Queue a request; raises ValueError when it can never be served."""
        if request.params.task is not self.pooler.task:
            raise ValueError(
                f"this model serves {self.pooler.task.value} requests, not "
                f"{request.params.task.value}"
            )
        vocab = self.source.hf_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is out of range for the vocabulary (0-{vocab - 1})"
            )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[PoolingOutput]:
        batch = self.scheduler.schedule()
        return self.runner.execute(batch) if batch else []

    def encode(self, requests: list[PoolingRequest]) -> list[PoolingOutput]:
        """Offline use: run `requests` to completion, outputs in their order."""
        for request in requests:
            self.add_request(request)
        done: dict[str, PoolingOutput] = {}
        while self.has_unfinished_requests():
            done.update((o.request_id, o) for o in self.step())
        return [done[r.request_id] for r in requests]
