"""Runs the model for one scheduled step: builds inputs, owns the KV cache, samples."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch

from model_server.config import EngineConfig
from model_server.engine.input_batch import SeqChunk, build_model_inputs
from model_server.engine.request import Request
from model_server.engine.scheduler import SchedulerOutput
from model_server.layers.attention import get_attention_backend
from model_server.layers.sampler import Sampler
from model_server.loader import ModelSource
from model_server.models.registry import build_model, init_dummy_weights
from model_server.platforms import Platform

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token: its own and the `top` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class ModelRunnerOutput:
    # Parallel to SchedulerOutput.scheduled_requests; None where the request did not sample
    # (a prefill chunk that does not reach the end of the prompt).
    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.dtype = platform.resolve_dtype(config.dtype)
        self.hf_config = source.hf_config
        self.block_size = config.block_size
        backend_name = config.attention_backend or platform.default_attention_backend
        self.attn_backend = get_attention_backend(backend_name)
        start = time.perf_counter()
        self.model = build_model(
            self.hf_config,
            self.attn_backend,
            dtype=self.dtype,
            device=self.device,
            max_model_len=config.max_model_len,
        )
        if source.weights is None:
            init_dummy_weights(self.model, seed=config.seed)
        else:
            self.model.load_weights(_with_progress(source.weights(), source.num_weights))
        self.model.eval()
        logger.info(
            "loaded %s (%s, %s) in %.2fs with the %s attention backend",
            source.path,
            self.hf_config.architectures[0],
            str(self.dtype).removeprefix("torch."),
            time.perf_counter() - start,
            backend_name,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        self.sampler = Sampler(self.device)
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache ---------------------------------------------------------------------------

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype

    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        # Per layer: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            self.platform.allocate_zeros(shape, self.kv_cache_dtype) for _ in range(m.num_layers)
        ]

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        reqs = scheduler_output.scheduled_requests
        chunks = [
            SeqChunk(
                token_ids=r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n],
                num_computed_tokens=r.num_computed_tokens,
                block_ids=r.block_ids,
            )
            for r, n in zip(reqs, scheduler_output.num_scheduled_tokens, strict=True)
        ]
        inputs = build_model_inputs(chunks, self.block_size, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
        )
        # Rows (in batch order) whose step reaches the end of their tokens: those sample.
        sample_rows = [
            row
            for row, idx in enumerate(inputs.order)
            if reqs[idx].num_computed_tokens + scheduler_output.num_scheduled_tokens[idx]
            == reqs[idx].num_tokens
        ]
        sampled: list[int | None] = [None] * len(reqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        if not sample_rows:
            return ModelRunnerOutput(sampled, logprobs)
        sample_reqs = [reqs[inputs.order[row]] for row in sample_rows]
        row_index = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[inputs.last_token_indices[row_index]])
        metadata = self.sampler.build_metadata(sample_reqs, self.vocab_size)
        out = self.sampler(logits, metadata)
        token_ids = out.sampled_token_ids.tolist()
        want_logprobs = out.logprobs is not None
        if want_logprobs:
            lp = out.logprobs.tolist()
            top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
            top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for j, row in enumerate(sample_rows):
            idx = inputs.order[row]
            sampled[idx] = token_ids[j]
            k = reqs[idx].sampling_params.logprobs
            if want_logprobs and k is not None:
                top = list(zip(top_ids[j][:k], top_lp[j][:k], strict=True)) if top_ids else []
                logprobs[idx] = TokenLogprobs(token_ids[j], lp[j], top)
        return ModelRunnerOutput(sampled, logprobs)

    def release(self, request: Request) -> None:
        """Drop per-request sampler state (seeded generators) once a request is finished."""
        self.sampler.release(request.request_id)


def _with_progress(weights, total: int):
    """Wrap the weight iterator in a progress bar on stderr when it is a terminal."""
    if not sys.stderr.isatty() or total <= 0:
        yield from weights
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
        for item in weights:
            yield item
            bar.update(1)
