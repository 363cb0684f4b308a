"""Runs the model for one scheduled step: builds inputs, owns the KV cache, samples."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import torch

from model_server.config import SpeculativeConfig
from model_server.distributed.parallel_state import get_tensor_model_parallel_rank
from model_server.engine.core.kv_cache_manager import SlidingWindowSpec
from model_server.engine.core.request import Request
from model_server.engine.core.scheduler import SchedulerOutput
from model_server.engine.execution.cuda_graph import CUDAGraphRunner, capture_sizes
from model_server.engine.execution.draft_model import DraftModelProposer, prepare_draft_model
from model_server.engine.execution.input_batch import SeqChunk, build_model_inputs
from model_server.engine.execution.kv_cache_groups import KVCacheGroups
from model_server.engine.execution.memory_profiler import (
    MemoryProfile,
    MemorySnapshot,
    check_kv_blocks,
    profile_chunks,
    profile_memory,
    profile_sampling_requests,
)
from model_server.engine.execution.model_preparation import PreparedModel
from model_server.engine.execution.step_input import PromptLogprobsRows, StepInput
from model_server.engine.outputs import ModelRunnerOutput, TokenLogprobs
from model_server.engine.spec_decode.row_invariance import verification_rows
from model_server.engine.spec_decode.verify import accept_drafts
from model_server.kernels.kv_cache_dtype import (
    KVCacheDtype,
    QuantizedKVCache,
    allocate_kv_cache,
)
from model_server.layers.attention import get_attention_backend
from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata
from model_server.layers.sampler import PromptLogprobsOutput, Sampler, compute_prompt_logprobs
from model_server.lora.config import LoRAConfig
from model_server.lora.manager import LoRAModelManager
from model_server.lora.request import LoRARequest
from model_server.platforms import Platform
from model_server.sampling_params import MAX_LOGPROBS
from model_server.structured_output.bitmask import fill_grammar_bitmask

logger = logging.getLogger(__name__)

# Prompt logprobs run the LM head over a prompt's rows in pieces of at most this many logits
# (64 MiB in float32), so that a long prompt's memory stays bounded.
PROMPT_LOGPROBS_MAX_ELEMENTS = 1 << 24


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor | None  # [N, vocab], the model's dtype, on rank 0 when N > 0; else None
    sample_indices: list[int]  # row j of logits belongs to chunk sample_indices[j]
    # Rank 0: chunk index -> its prompt logprobs, piece by piece (see PromptLogprobsRows).
    prompt_logprobs: dict[int, list[PromptLogprobsOutput]] | None = None
    # Speculative decoding: chunk index -> its drafts. Such a chunk has len(drafts) + 1
    # consecutive rows in `logits` (sample_indices repeats its index), the target's logits after
    # its last token and after each draft.
    drafts: dict[int, list[int]] | None = None


class ModelRunner:
    """One rank's prepared model (engine/execution/model_preparation.py), its KV cache, its
    step (the native decoder step where the platform gave one, else the modules; CUDA graphs
    for decodes and verifications) and (rank 0) the sampler. `self.config` is the engine's
    with `max_model_len` resolved (the same on every rank, so their rotary caches match)."""

    def __init__(self, prepared: PreparedModel, platform: Platform) -> None:
        self.prepared = prepared
        self.config = prepared.config
        self.max_model_len: int = prepared.resolved.max_model_len
        self.max_model_len_given = prepared.resolved.max_model_len_given
        self.platform = platform
        self.device = platform.device
        self.model = prepared.model
        self.hf_config = prepared.hf_config
        self.dtype = prepared.resolved.dtype
        self.block_size = self.config.block_size
        self.kv_dtype: KVCacheDtype = prepared.kv_dtype
        # Device memory in use before our weights load is not ours: neither charged to our
        # budget nor taken (memory_profiler.py). None where memory cannot be profiled.
        self.memory_baseline: MemorySnapshot | None = prepared.memory_baseline
        # This rank's budget once `local_num_blocks` has profiled it.
        self.memory_profile: MemoryProfile | None = None
        self.quantization_description: str | None = prepared.quantization_description
        self.gguf_kept = prepared.gguf_kept
        self.attn_backend = get_attention_backend(prepared.resolved.attention_backend)
        self.kv_groups: KVCacheGroups = prepared.kv_groups
        # The runner's CPU fast path: the decoder layers in one native call (None: modules).
        self.native_step = prepared.native_step
        # --enable-lora: the LoRA-able layers wrapped, the --lora-modules adapters read (a bad
        # one fails the start). Steps with adapter tokens run in the native step where it took
        # the adapters' slots (`attach_lora`), else the modules; never a graph (graphs are off
        # with LoRA).
        lora_config = LoRAConfig.from_engine_config(self.config)
        self.lora_manager: LoRAModelManager | None = None
        self.native_lora = False  # the native step runs the adapters' products
        self.native_lora_steps = 0  # steps with adapters it ran (for tests and people)
        if lora_config is not None:
            self.lora_manager = LoRAModelManager(self.model, lora_config, self.device, self.dtype)
            for request in lora_config.static_requests():
                self.lora_manager.add_adapter(request)
            if self.native_step is not None:
                why = self.native_step.attach_lora(self.lora_manager.stacks())
                self.native_lora = why is None
                if why is not None:
                    logger.info("steps with LoRA adapters run module by module: %s", why)
        logger.info(
            "loaded %s (%s, %s%s, %s KV cache) in %.2fs with the %s attention backend",
            prepared.source_path,
            self.hf_config.architectures[0],
            str(self.dtype).removeprefix("torch."),
            (f", {self.quantization_description} weights" if self.quantization_description else "")
            + (f", GGUF matrices kept quantized ({self.gguf_kept})" if self.gguf_kept else ""),
            self.kv_dtype.name,
            prepared.load_seconds,
            prepared.resolved.attention_backend,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        # Only rank 0 samples (it alone gets logits), so only it keeps sampler state.
        self.sampler = (
            Sampler(self.device, platform.kernel_table().argmax)
            if get_tensor_model_parallel_rank() == 0
            else None
        )
        # One per layer: a tensor, or codes + scales for quantized --kv-cache-dtype.
        self.kv_caches: list[torch.Tensor | QuantizedKVCache] = []
        # Set by `capture_graphs` once the KV cache exists (None: every step runs eagerly).
        self.graph_runner: CUDAGraphRunner | None = None
        # --speculative-config with a draft model: it fills the scheduler's placeholder drafts
        # before each step (engine/execution/draft_model.py); its cache mirrors this one's.
        self.drafter: DraftModelProposer | None = None
        # --speculative-config, parsed once (None: off); the graphs' row buckets read it too.
        self.speculative = spec = SpeculativeConfig.parse(self.config.speculative_config)
        if spec is not None and spec.uses_draft_model:
            if self.kv_groups.hybrid:
                raise ValueError(
                    "speculative_config: a draft model needs a target without a sliding-window "
                    "block pool (its cache mirrors the target's one block table)"
                )
            draft = prepare_draft_model(self.config, spec, self.hf_config, self.dtype, platform)
            self.drafter = DraftModelProposer(ModelRunner(draft, platform))

    # ---- KV cache ---------------------------------------------------------------------------

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The cache tensors' element type (the codes' for a quantized cache)."""
        return self.kv_dtype.storage

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's KV cache tensor: the model's own layout where it declares one
        (`kv_cache_shape(num_blocks, block_size)`: DeepSeek's latent cache), else
        [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]."""
        m = self.model
        if hasattr(m, "kv_cache_shape"):
            return tuple(m.kv_cache_shape(num_blocks, self.block_size))
        return (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    def layer_block_bytes(self) -> int:
        """One block of one layer's cache (K and V, or the model's own layout), with the
        scales of a quantized cache ([2, 1, block_size, Hkv] float32)."""
        shape = self.kv_cache_shape(1)
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        scales = math.prod(shape[:-1]) * 4 if self.kv_dtype.quantized else 0
        return math.prod(shape) * elem + scales

    def bytes_per_block(self) -> int:
        """One block of every layer (what a token range costs without sliding-window groups),
        the draft model's block included: its cache has a block for each of ours."""
        draft = self.drafter.bytes_per_block() if self.drafter is not None else 0
        return self.model.num_layers * self.layer_block_bytes() + draft

    def kv_cache_bytes(self, num_blocks: int) -> int:
        """This rank's KV caches for `num_blocks` blocks: every layer's, the draft's included."""
        draft = self.drafter.bytes_per_block() * num_blocks if self.drafter is not None else 0
        return self.kv_groups.cache_bytes(num_blocks, self.layer_block_bytes()) + draft

    def _num_blocks_for_budget(self, budget: int) -> int:
        if self.drafter is not None:  # never with sliding-window groups (refused)
            return budget // self.bytes_per_block()
        return self.kv_groups.num_blocks_for_budget(budget, self.layer_block_bytes())

    def sliding_window_spec(self, num_blocks: int) -> SlidingWindowSpec | None:
        """The sliding-window pool that goes with `num_blocks` full-group blocks, if any."""
        groups = self.kv_groups
        if not groups.hybrid:
            return None
        assert groups.sliding_window is not None
        return SlidingWindowSpec(groups.sliding_num_blocks(num_blocks), groups.sliding_window)

    def local_num_blocks(self, kv_cache_memory: int | None) -> int:
        """KV blocks this rank's budget holds: `kv_cache_memory` bytes when given; else, where
        the platform can profile memory, what `gpu_memory_utilization` leaves after a profiled
        forward (engine/execution/memory_profiler.py; 0 when nothing is left: the caller checks the
        count, once reduced over the ranks, with `check_num_blocks`); else the platform's
        default budget. Every rank calls this at the same time: the profile holds collectives.
        """
        bytes_per_block = self.bytes_per_block()
        if kv_cache_memory:
            return self._num_blocks_for_budget(kv_cache_memory)
        if not self.platform.can_profile_memory():
            budget = self.platform.default_kv_cache_memory(bytes_per_block)
            return self._num_blocks_for_budget(budget)
        assert self.memory_baseline is not None  # taken in __init__ where memory can be profiled
        utilization = self.config.gpu_memory_utilization
        profile = profile_memory(self.platform, self.profile_run, self.memory_baseline, utilization)
        self.memory_profile = profile
        num_blocks = self._num_blocks_for_budget(max(0, profile.kv_cache_memory))
        if profile.capped:
            logger.warning(
                "gpu_memory_utilization %.2f asks for more than was free when the engine "
                "started: using the free %.2f GiB instead, with no headroom left on the device",
                profile.utilization,
                profile.usable / 1024**3,
            )
        logger.info("%s: %d blocks of %.2f MiB", profile, num_blocks, bytes_per_block / 1024**2)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        spec = self.sliding_window_spec(num_blocks)
        sliding = set(self.kv_groups.sliding_layers)
        # Per layer: [2 (k, v), blocks of its group's pool, block_size, num_kv_heads, head_dim]
        # (or the model's own layout, kv_cache_shape).
        self.kv_caches = [
            allocate_kv_cache(
                self.kv_cache_shape(
                    spec.num_blocks if spec is not None and i in sliding else num_blocks
                ),
                self.kv_dtype,
                self.platform.allocate_zeros,
                None if self.prepared.kv_fixed_scales is None else self.prepared.kv_fixed_scales[i],
            )
            for i in range(m.num_layers)
        ]
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        self.capture_graphs()  # the graphs hold the caches' addresses: capture after allocating

    def check_num_blocks(self, num_blocks: int) -> None:
        """Raise ValueError (with the budget's numbers) when `num_blocks`, a profiled count
        reduced over the ranks, cannot hold one sequence of a `--max-model-len` the user gave
        (the model's own length is fitted to the cache instead: EngineCore._fit_max_model_len),
        or fewer than the engine's 2 blocks. A given `--kv-cache-memory` is the user's call:
        nothing to check then."""
        if self.memory_profile is None:
            return
        max_model_len = self.max_model_len if self.max_model_len_given else None
        check_kv_blocks(
            self.memory_profile, num_blocks, self.bytes_per_block(), max_model_len, self.block_size
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Every rank: the largest step the scheduler can issue, for its peak memory. A forward
        of the step's token budget as prefills (`profile_chunks`) on a one-block scratch KV
        cache, then the LM head and (rank 0) the sampler on `max_num_seqs` rows, the most a
        step samples. Nothing is kept; the scratch cache is freed on return."""
        m = self.model
        chunks = profile_chunks(self.config, self.max_model_len, self.block_size)
        scratch_shape = self.kv_cache_shape(1)
        scratch = [
            allocate_kv_cache(scratch_shape, self.kv_dtype, self.platform.allocate_zeros)
            for _ in range(m.num_layers)
        ]
        inputs = build_model_inputs(chunks, self.block_size, self.device)
        hidden = m(inputs.input_ids, inputs.positions, scratch, inputs.attn_metadata)
        rows = torch.arange(min(self.config.max_num_seqs, hidden.shape[0]), device=self.device)
        logits = m.compute_logits(hidden[rows])  # a collective under tensor parallelism
        if logits is not None and self.sampler is not None:
            requests = profile_sampling_requests(logits.shape[0])
            self.sampler(logits, self.sampler.build_metadata(requests, self.vocab_size))
        del logits
        # One piece of prompt logprobs, the most a step holds of them at once.
        rows = torch.arange(min(self.prompt_logprobs_rows, hidden.shape[0]), device=self.device)
        logits = m.compute_logits(hidden[rows])
        if logits is not None:
            compute_prompt_logprobs(logits, torch.zeros_like(rows), MAX_LOGPROBS)
        self.platform.mark_step()

    @property
    def prompt_logprobs_rows(self) -> int:
        """Rows of one LM-head piece for prompt logprobs (PROMPT_LOGPROBS_MAX_ELEMENTS)."""
        return max(1, PROMPT_LOGPROBS_MAX_ELEMENTS // self.vocab_size)

    # ---- device graphs ----------------------------------------------------------------------

    def graphs_enabled(self) -> bool:
        """Decode steps replay device graphs unless `enforce_eager`, the platform cannot
        capture, or the attention backend or the model (quantized MoE experts) reads host
        values that change every step."""
        return (
            not self.config.enforce_eager
            and self.platform.supports_graphs
            and self.attn_backend.supports_graphs
            and getattr(self.model, "supports_graphs", True)
            and not self.kv_groups.hybrid  # the graphs bind one block table per step
            and self.lora_manager is None  # the adapters' row groups change every step
        )

    def graph_verification_rows(self) -> int:
        """The most rows a verification step can have (0: speculation off), so that the graphs'
        row buckets reach it: `verification_rows`, bounded by the running requests (at most
        max_num_seqs, each its last token and k drafts) and by the step's token budget."""
        spec = self.speculative
        if spec is None:
            return 0
        rows = min(
            verification_rows(spec), self.config.max_num_seqs * (spec.num_speculative_tokens + 1)
        )
        budget = self.config.max_num_batched_tokens
        return rows if budget is None else min(rows, budget)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the decode and verification graphs (after `allocate_kv_cache`; every rank at
        the same time, since the forward holds collectives). A no-op when graphs are disabled."""
        if not self.graphs_enabled():
            return
        max_len = self.model.max_position
        # One instance per distinct layer configuration (KV heads, window) is enough.
        impls = {
            (impl.num_kv_heads, impl.sliding_window): impl
            for module in self.model.modules()
            if isinstance(impl := getattr(module, "impl", None), AttentionBackend)
        }.values()

        def context_bounds(bs: int) -> list[int]:
            bounds = {
                b for impl in impls for b in impl.graph_context_bounds(bs, max_len, self.device)
            }
            return sorted(bounds) or [max_len]

        self.graph_runner = CUDAGraphRunner(
            lambda ids, positions, md: self.model(ids, positions, self.kv_caches, md),
            self.platform.graph_capturer(),
            sizes=capture_sizes(
                self.config.max_num_seqs, verification_rows=self.graph_verification_rows()
            ),
            block_size=self.block_size,
            max_model_len=max_len,
            device=self.device,
            context_bounds=context_bounds,
        )
        self.graph_runner.capture()
        self.platform.synchronize()

    # ---- one step ---------------------------------------------------------------------------

    def prepare_step(self, scheduler_output: SchedulerOutput) -> StepInput:
        """Rank 0: what each scheduled request computes this step (with a draft model, which
        first fills the placeholder drafts in `scheduled_spec_decode_tokens`)."""
        if self.drafter is not None:
            self.drafter.propose(scheduler_output)
        chunks: list[SeqChunk] = []
        sample: list[bool] = []
        prompt_logprobs: list[PromptLogprobsRows | None] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_drafts: list[int] = []
        for r, n in zip(
            scheduler_output.scheduled_requests, scheduler_output.num_scheduled_tokens, strict=True
        ):
            start = r.num_computed_tokens
            drafts = spec.get(r.request_id, [])
            n -= len(drafts)  # the drafts follow the request's own tokens
            chunks.append(
                # The sliding table is copied: the KV manager nulls its entries in place.
                SeqChunk(
                    r.all_token_ids[start : start + n] + drafts,
                    start,
                    r.block_ids,
                    list(r.sliding_block_ids),
                    # Verification rows attend exactly as their decodes would.
                    attend_as_decodes=bool(drafts),
                )
            )
            sample.append(start + n == r.num_tokens)
            prompt_logprobs.append(_prompt_logprobs_rows(r, start, n))
            num_drafts.append(len(drafts))
        return StepInput(
            chunks,
            sample,
            prompt_logprobs if any(prompt_logprobs) else [],
            num_drafts if spec else [],
            loras=_step_loras(scheduler_output.scheduled_requests),
        )

    def forward_chunks(
        self, chunks: list[SeqChunk], loras: list[LoRARequest | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Hidden states [T, hidden], the flat index of each request's last token [B] in batch
        order (None: token i is request i's only one) and the batch order (batch row -> index
        in `chunks`). `loras`: parallel to chunks, each one's adapter (empty or None: none)."""
        bucket = self.graph_runner.bucket_for(chunks) if self.graph_runner else None
        if bucket is not None:
            # Decodes and verifications only: every chunk attends as decodes, so the batch
            # order is the chunk order and the rows are each chunk's tokens in turn, as eager.
            hidden = self.graph_runner.run(chunks, bucket)
            if hidden.shape[0] == len(chunks):
                return hidden, None, list(range(len(chunks)))
            ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
            last = torch.tensor([e - 1 for e in ends], dtype=torch.int64).to(self.device)
            return hidden, last, list(range(len(chunks)))
        inputs = build_model_inputs(chunks, self.block_size, self.device)
        if not loras:
            hidden = self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            return hidden, inputs.last_token_indices, inputs.order
        assert self.lora_manager is not None  # requests carry adapters only with --enable-lora
        # The adapters' rows in the flat batch: its sequences in batch order.
        self.lora_manager.prepare_batch(
            [(loras[idx], len(chunks[idx].token_ids)) for idx in inputs.order]
        )
        try:
            slots = self.lora_manager.batch.token_slots
            hidden = self._run_model(
                inputs.input_ids,
                inputs.positions,
                inputs.attn_metadata,
                lora_slots=slots,
                native=self.native_lora or slots is None,
            )
        finally:
            self.lora_manager.clear_batch()
        return hidden, inputs.last_token_indices, inputs.order

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
        native: bool = True,
    ) -> torch.Tensor:
        """The final-norm hidden states [T, hidden]: the layers in one native call where
        `native` allows and the native step takes this step, else the model's modules.
        `lora_slots`: each row's LoRA slot (the manager's batch, which the modules read)."""
        step = self.native_step
        if native and step is not None and step.takes(input_ids.shape[0], self.kv_caches):
            decoder = self.model.model
            hidden = decoder.embed(input_ids)
            out = step(positions, hidden, self.kv_caches, attn_metadata, lora_slots=lora_slots)
            self.native_lora_steps += lora_slots is not None
            return decoder.norm(*out)[0]
        return self.model(input_ids, positions, self.kv_caches, attn_metadata)

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Every rank: the forward pass, and the logits of the sampling rows ([N, vocab] on rank
        0, None elsewhere; the LM head's gather is a collective, so every rank calls it)."""
        hidden, last_token_indices, order = self.forward_chunks(step.chunks, step.loras)
        prompt_logprobs = (
            self._prompt_logprobs(hidden, step, order) if step.prompt_logprobs else None
        )
        # Rows (in batch order) whose step reaches the end of their tokens: those sample.
        sample_rows = [row for row, idx in enumerate(order) if step.sample[idx]]
        if step.num_drafts and sample_rows:
            return self._verification_logits(hidden, step, order, sample_rows, prompt_logprobs)
        logits = None
        if last_token_indices is None and len(sample_rows) == len(order):
            logits = self.model.compute_logits(hidden)  # every decode samples: no gather
        elif sample_rows:
            row_index = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            if last_token_indices is not None:
                row_index = last_token_indices[row_index]
            logits = self.model.compute_logits(hidden[row_index])
        self.platform.mark_step()
        return StepOutput(logits, [order[row] for row in sample_rows], prompt_logprobs)

    def _verification_logits(
        self,
        hidden: torch.Tensor,
        step: StepInput,
        order: list[int],
        sample_rows: list[int],
        prompt_logprobs: dict[int, list[PromptLogprobsOutput]] | None,
    ) -> StepOutput:
        """The logits of a step with drafts: a sampling chunk with d drafts gets its last d + 1
        rows (its flat rows are contiguous, its last token's first), the others their last."""
        ends = list(itertools.accumulate(len(step.chunks[idx].token_ids) for idx in order))
        flat: list[int] = []
        sample_indices: list[int] = []
        drafts: dict[int, list[int]] = {}
        for row in sample_rows:
            idx = order[row]
            d = step.num_drafts[idx]
            flat.extend(range(ends[row] - d - 1, ends[row]))
            sample_indices.extend([idx] * (d + 1))
            if d:
                drafts[idx] = list(step.chunks[idx].token_ids[-d:])
        index = torch.tensor(flat, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[index])
        self.platform.mark_step()
        return StepOutput(logits, sample_indices, prompt_logprobs, drafts)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, step: StepInput, order: list[int]
    ) -> dict[int, list[PromptLogprobsOutput]] | None:
        """Every rank: the LM head over the rows of the chunks that compute prompt logprobs, a
        bounded piece at a time (a collective under tensor parallelism: the same pieces on every
        rank); rank 0 turns each piece into logprobs at once, so that no more than one piece's
        logits live at a time. None on the other ranks."""
        flat_start: dict[int, int] = {}
        offset = 0
        for idx in order:  # hidden's rows are in batch order
            flat_start[idx] = offset
            offset += len(step.chunks[idx].token_ids)
        piece = self.prompt_logprobs_rows
        out: dict[int, list[PromptLogprobsOutput]] = {}
        for idx in range(len(step.chunks)):
            rows = step.prompt_logprobs_of(idx)
            if rows is None:
                continue
            pieces = out.setdefault(idx, [])
            for a in range(0, rows.num_rows, piece):
                b = min(a + piece, rows.num_rows)
                logits = self.model.compute_logits(
                    hidden[flat_start[idx] + a : flat_start[idx] + b]
                )
                if logits is None:
                    continue  # not rank 0
                targets = torch.tensor(rows.target_ids[a:b], dtype=torch.int64, device=self.device)
                pieces.append(compute_prompt_logprobs(logits, targets, rows.k))
                del logits  # one piece's logits at a time
        return out if self.sampler is not None else None

    @torch.inference_mode()
    def sample(self, reqs: list[Request], out: StepOutput) -> ModelRunnerOutput:
        """Rank 0: sample the next token of each sampling request (`reqs`: scheduled order)."""
        sampled: list[int | None] = [None] * len(reqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
        prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
        if out.prompt_logprobs:
            prompt_logprobs = [None] * len(reqs)
            for idx, pieces in out.prompt_logprobs.items():
                prompt_logprobs[idx] = _prompt_logprob_entries(pieces)
        if out.logits is None:
            return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)
        sample_reqs = [reqs[idx] for idx in out.sample_indices]
        drafts = out.drafts or {}
        # Verification samples every row of a request with drafts as if decoding it one token
        # at a time (row i: the target's token after draft i - 1, from the request's own next
        # noise draw), so a draft is accepted iff the target would have produced it: greedy
        # and sampled output are exactly the non-speculative output. A seeded generator then
        # keeps only the draws of the emitted tokens (saved here, rewound below).
        generator_states = {
            idx: state
            for idx in drafts
            if not reqs[idx].sampling_params.greedy
            and (state := self.sampler.generator_state(reqs[idx].request_id)) is not None
        }
        grammar_bitmask = fill_grammar_bitmask(sample_reqs, self.vocab_size)
        metadata = self.sampler.build_metadata(sample_reqs, self.vocab_size, grammar_bitmask)
        result = self.sampler(out.logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        want_logprobs = result.logprobs is not None
        if want_logprobs:
            lp = result.logprobs.tolist()
            top_ids = (
                result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
            )
            top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None

        def row_logprobs(idx: int, j: int) -> TokenLogprobs | None:
            k = reqs[idx].sampling_params.logprobs
            if not want_logprobs or k is None:
                return None
            top = list(zip(top_ids[j][:k], top_lp[j][:k], strict=True)) if top_ids else []
            return TokenLogprobs(token_ids[j], lp[j], top)

        spec_token_ids: list[list[int]] | None = [[] for _ in reqs] if drafts else None
        spec_logprobs: list[list[TokenLogprobs | None]] | None = (
            [[] for _ in reqs] if drafts else None
        )
        j = 0
        while j < len(out.sample_indices):
            idx = out.sample_indices[j]
            sampled[idx] = token_ids[j]
            logprobs[idx] = row_logprobs(idx, j)
            if idx not in drafts:
                j += 1
                continue
            # Rows j .. j + d: the target's tokens after the last token and after each draft.
            d = len(drafts[idx])
            accepted = accept_drafts(drafts[idx], token_ids[j : j + d + 1])
            assert spec_token_ids is not None and spec_logprobs is not None
            spec_token_ids[idx] = token_ids[j + 1 : j + accepted + 1]
            spec_logprobs[idx] = [row_logprobs(idx, r) for r in range(j + 1, j + accepted + 1)]
            if idx in generator_states and accepted < d:
                request_id = reqs[idx].request_id
                self.sampler.rewind(
                    request_id, generator_states[idx], accepted + 1, self.vocab_size
                )
            j += d + 1
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, spec_token_ids, spec_logprobs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on a single rank: prepare, forward, sample."""
        out = self.execute_step(self.prepare_step(scheduler_output))
        return self.sample(scheduler_output.scheduled_requests, out)

    def release(self, request_ids: list[str]) -> None:
        """Drop the per-request sampler state (seeded generators) and draft state of finished
        requests."""
        if self.drafter is not None:
            self.drafter.release(request_ids)
        if self.sampler is not None:
            for request_id in request_ids:
                self.sampler.release(request_id)


def _step_loras(requests: list[Request]) -> list[LoRARequest | None]:
    """Each scheduled request's adapter, or [] when none has one."""
    loras = [r.lora_request for r in requests]
    return loras if any(lora is not None for lora in loras) else []


def _prompt_logprobs_rows(request: Request, start: int, n: int) -> PromptLogprobsRows | None:
    """The rows of `request`'s chunk [start, start + n) that predict prompt tokens, when it
    computes prompt logprobs: row i predicts token start + i + 1, up to the prompt's last token
    (the prompt's last row predicts the first output token: the sampler's)."""
    if not request.computes_prompt_logprobs:
        return None
    num_rows = min(start + n, request.num_prompt_tokens - 1) - start
    if num_rows <= 0:
        return None
    k = request.sampling_params.prompt_logprobs or 0
    targets = request.prompt_token_ids[start + 1 : start + 1 + num_rows]
    return PromptLogprobsRows(num_rows, k, targets)


def _prompt_logprob_entries(pieces: list[PromptLogprobsOutput]) -> list[TokenLogprobs]:
    """One chunk's prompt logprobs as plain entries, in position order."""
    entries: list[TokenLogprobs] = []
    for p in pieces:
        rows = zip(
            p.target_ids.tolist(),
            p.logprobs.tolist(),
            p.ranks.tolist(),
            p.top_ids.tolist(),
            p.top_logprobs.tolist(),
            strict=True,
        )
        for token_id, lp, rank, top_ids, top_lp in rows:
            entries.append(
                TokenLogprobs(token_id, lp, list(zip(top_ids, top_lp, strict=True)), rank)
            )
    return entries
