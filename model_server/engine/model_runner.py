"""Runs the model for one scheduled step: builds inputs, owns the KV cache, samples."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import torch

from model_server.config import EngineConfig
from model_server.distributed.parallel_state import get_tensor_model_parallel_rank
from model_server.engine.input_batch import SeqChunk, build_model_inputs
from model_server.engine.request import Request
from model_server.engine.scheduler import SchedulerOutput
from model_server.engine.step_input import StepInput
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
class StepOutput:
    logits: torch.Tensor | None  # [N, vocab] float32 on rank 0 when N > 0, else None
    sample_indices: list[int]  # row j of logits belongs to chunk sample_indices[j]


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
        # Only rank 0 samples (it alone gets logits), so only it keeps sampler state.
        self.sampler = Sampler(self.device) if get_tensor_model_parallel_rank() == 0 else None
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache ---------------------------------------------------------------------------

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.dtype

    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def local_num_blocks(self, kv_cache_memory: int | None) -> int:
        """KV blocks this rank's budget holds (`None`: the platform's default budget)."""
        bytes_per_block = self.bytes_per_block()
        budget = kv_cache_memory or self.platform.default_kv_cache_memory(bytes_per_block)
        return budget // bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        # Per layer: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = [
            self.platform.allocate_zeros(shape, self.kv_cache_dtype) for _ in range(m.num_layers)
        ]

    # ---- one step ---------------------------------------------------------------------------

    def prepare_step(self, scheduler_output: SchedulerOutput) -> StepInput:
        """Rank 0: what each scheduled request computes this step."""
        chunks: list[SeqChunk] = []
        sample: list[bool] = []
        for r, n in zip(
            scheduler_output.scheduled_requests, scheduler_output.num_scheduled_tokens, strict=True
        ):
            start = r.num_computed_tokens
            chunks.append(SeqChunk(r.all_token_ids[start : start + n], start, r.block_ids))
            sample.append(start + n == r.num_tokens)
        return StepInput(chunks, sample)

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Every rank: the forward pass, and the logits of the sampling rows ([N, vocab] on rank
        0, None elsewhere; the LM head's gather is a collective, so every rank calls it)."""
        inputs = build_model_inputs(step.chunks, self.block_size, self.device)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
        )
        # Rows (in batch order) whose step reaches the end of their tokens: those sample.
        sample_rows = [row for row, idx in enumerate(inputs.order) if step.sample[idx]]
        logits = None
        if sample_rows:
            row_index = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[inputs.last_token_indices[row_index]])
        self.platform.mark_step()
        return StepOutput(logits, [inputs.order[row] for row in sample_rows])

    @torch.inference_mode()
    def sample(self, reqs: list[Request], out: StepOutput) -> ModelRunnerOutput:
        """Rank 0: sample the next token of each sampling request (`reqs`: scheduled order)."""
        sampled: list[int | None] = [None] * len(reqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        if out.logits is None:
            return ModelRunnerOutput(sampled, logprobs)
        sample_reqs = [reqs[idx] for idx in out.sample_indices]
        metadata = self.sampler.build_metadata(sample_reqs, self.vocab_size)
        result = self.sampler(out.logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        want_logprobs = result.logprobs is not None
        if want_logprobs:
            lp = result.logprobs.tolist()
            top_ids = (
                result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
            )
            top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for j, idx in enumerate(out.sample_indices):
            sampled[idx] = token_ids[j]
            k = reqs[idx].sampling_params.logprobs
            if want_logprobs and k is not None:
                top = list(zip(top_ids[j][:k], top_lp[j][:k], strict=True)) if top_ids else []
                logprobs[idx] = TokenLogprobs(token_ids[j], lp[j], top)
        return ModelRunnerOutput(sampled, logprobs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on a single rank: prepare, forward, sample."""
        out = self.execute_step(self.prepare_step(scheduler_output))
        return self.sample(scheduler_output.scheduled_requests, out)

    def release(self, request: Request) -> None:
        """Drop per-request sampler state (seeded generators) once a request is finished."""
        if self.sampler is not None:
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
