"""Decode and verification steps replayed from device graphs (CUDA graphs), one graph per
row bucket.

Why: at small batches a decode step's GPU work takes a few milliseconds, and eager PyTorch
spends as long again launching ~15 kernels per layer from Python. A replay launches the whole
forward at once.

What is captured: the model's forward (embedding to final norm) for `rows` query rows, each its
own one-query sequence in the attention metadata (num_decodes = rows, max_query_len 1, query
i at query_start_loc i), reading its inputs from static device buffers and writing hidden
states [rows, hidden] into a static output. The LM head and the sampler stay eager and run on
the real rows only.

Which steps: those whose every chunk attends as decodes. A decode step of B requests is B
rows. A speculative verification step (a request's last token then its n <= k drafts, n
varying per request with the acceptance feedback, beside plain decodes) is, in the eager path
too, one one-query sequence per token (`SeqChunk.attend_as_decodes`, see
spec_decode/row_invariance.py): its T = sum(1 + n_i) tokens are T rows, in the eager path's
flat order (chunk by chunk), each with its own position, slot, context length (its position
+ 1) and its request's block table. So verification needs no graph of its own shape and no
padding per request: the query width is in the rows, and a verification replays the same
graphs as decodes of as many rows, whatever its mix of draft counts. Real rows attend exactly
as in the eager step: the same decode kernel on the same per-row metadata.

Buckets: 1, 2, 4, then multiples of 8 rows, up to the most rows a graph step can have: the
decode batch (min(max_num_seqs, MAX_CAPTURE_SIZE)) or, with speculation configured, the
verification rows (speculation runs only below `disable_by_batch_size` requests, each at most
1 + k rows: `verification_rows`, also bounded by max_num_seqs and the step's token budget).
That bound, (disable_by_batch_size - 1) x (1 + k) rows (15 at the default 4 and k = 4), is
usually below the decode batch's, so speculation adds no graph; it adds buckets only where
max_num_seqs is smaller.

Padding: a step of T rows replays the smallest bucket >= T. Rows T.. get slot -1 (the KV
store skips them) and seq_len 0 (attention reads nothing and returns zeros); their hidden rows
are never read.

Host values baked into a graph: num_decodes = rows and a context-length bound (`seq_lens_cpu`
/ `max_seq_len` of the captured metadata, which graph-capable backends use only as bounds; the
kernels read the real lengths from `seq_lens`). The bound decides the decode's split-K, so each
bucket is captured at the context bounds its attention backend tells apart
(`AttentionBackend.graph_context_bounds`: for the Triton backend, powers of two of its split
length up to max_model_len, one per split count) and a step replays the smallest bound >= the
longest context in its batch: short contexts no longer pay max_model_len's 16 splits and reduce.
Only backends whose class sets `supports_graphs` are captured.

Step inputs: one persistent host staging buffer per input (pinned on CUDA, so the copies are
truly asynchronous), filled through numpy views and copied into the static device buffers each
step. Before overwriting the staging buffers a step waits for the previous step's copies (an
event), which the sampler's host read has normally completed already.

Invariants: the KV cache is allocated before capture and never reallocated (graphs hold its
addresses); graphs are captured largest first into one shared memory pool, so the smaller ones
reuse its blocks; under tensor parallelism every rank captures the same buckets in the same
order and replays the same graph each step (the choice depends only on the step's chunks and
on the context bounds, which come from host values alike on ranks of one GPU model).

Only the CPU stand-in (tests/kernels/test_cuda_graph.py: interpreted Triton, a capturer that
reruns the function under a guard against uncapturable ops) has run verification graphs so
far; the `gpu` tests there run real graphs where CUDA is present.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from model_server.engine.execution.input_batch import SeqChunk
from model_server.layers.attention.backend import AttentionMetadata
from model_server.platforms.interface import GraphCapturer

logger = logging.getLogger(__name__)

# Largest batch captured by default: bigger decode batches are compute-bound, where a graph
# saves a negligible share of the step (vLLM's default bound too).
MAX_CAPTURE_SIZE = 512

# Forward of the model on static inputs: (input_ids, positions, metadata) -> hidden [bs, hidden].
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# Context-length bounds to capture a batch size at, ascending; the last one is max_model_len.
ContextBoundsFn = Callable[[int], Sequence[int]]


class GraphKey(NamedTuple):
    """One captured graph: its row bucket (query rows: a decode's requests, a verification's
    tokens) and the context-length bound it was captured at."""

    batch_size: int
    max_context: int


def capture_sizes(
    max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE, verification_rows: int = 0
) -> list[int]:
    """Row buckets 1, 2, 4, then multiples of 8, up to the first that holds min(max_num_seqs,
    max_capture_size) rows (so every decode batch the scheduler can form up to that bound has a
    bucket), or min(verification_rows, max_capture_size) where that is more (every
    verification step of at most that many tokens)."""
    limit = max(1, min(max_num_seqs, max_capture_size), min(verification_rows, max_capture_size))
    sizes: list[int] = []
    for size in [1, 2, 4, *range(8, limit + 8, 8)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


class CUDAGraphRunner:
    """Captures `forward` per row bucket and runs eligible decode and verification steps
    through the graphs."""

    def __init__(
        self,
        forward: ForwardFn,
        capturer: GraphCapturer,
        *,
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        context_bounds: ContextBoundsFn | None = None,
    ) -> None:
        self.forward = forward
        self.capturer = capturer
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.context_bounds = context_bounds or (lambda bs: [max_model_len])
        max_bs = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Rows: input_ids, positions, slot_mapping (one int64 host-to-device copy per step).
        # Columns: query rows (one per token of a chunk attending as decodes).
        self.token_inputs = torch.zeros((3, max_bs), dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_bs, self.max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # Host staging buffers of the same shapes; numpy views write them without building
        # tensors from lists. Pinned (page-locked) wherever CUDA can pin host memory, so the
        # copies to the device are asynchronous; the CPU stand-ins of the tests run unpinned.
        pin = torch.cuda.is_available()
        self.host_token_inputs = torch.zeros((3, max_bs), dtype=torch.int64, pin_memory=pin)
        self.host_seq_lens = torch.zeros(max_bs, dtype=torch.int32, pin_memory=pin)
        self.host_block_tables = torch.zeros(
            (max_bs, self.max_blocks_per_seq), dtype=torch.int32, pin_memory=pin
        )
        self._np_tokens = self.host_token_inputs.numpy()
        self._np_seq_lens = self.host_seq_lens.numpy()
        self._np_tables = self.host_block_tables.numpy()
        # Recorded after each step's copies; waited on before the staging buffers are rewritten.
        self._copies_done = torch.cuda.Event() if pin else None
        # (row bucket, context bound) -> (replay, static hidden states [bucket, hidden])
        self.graphs: dict[GraphKey, tuple[Callable[[], None], torch.Tensor]] = {}
        # row bucket -> its captured context bounds, ascending
        self.bounds: dict[int, list[int]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int, max_context: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.token_inputs[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=max_context,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[max_context] * bs,  # bounds, see the module docstring
        )

    def capture(self) -> None:
        """Capture every bucket at each of its context bounds, largest first. Static inputs hold
        padding rows only, so the warm-up and capture runs write nothing to the KV cache."""
        start = time.perf_counter()
        self.token_inputs[0:2].zero_()
        self.token_inputs[2].fill_(-1)
        self.seq_lens.zero_()
        self.block_tables.zero_()
        for bs in reversed(self.sizes):
            bounds = sorted({min(b, self.max_model_len) for b in self.context_bounds(bs)})
            if not bounds or bounds[-1] < self.max_model_len:
                bounds.append(self.max_model_len)  # every context length has a graph
            self.bounds[bs] = bounds
            for max_context in reversed(bounds):
                metadata = self._metadata(bs, max_context)
                ids, positions = self.token_inputs[0, :bs], self.token_inputs[1, :bs]

                def run(ids=ids, positions=positions, metadata=metadata) -> torch.Tensor:
                    return self.forward(ids, positions, metadata)

                run()  # warm-up: JIT compiles, library handles and workspaces outside the capture
                self.graphs[GraphKey(bs, max_context)] = self.capturer.capture(run)
        logger.info(
            "captured %d decode/verification graphs (row buckets %s) in %.1fs",
            len(self.graphs),
            _ranges(self.sizes),
            time.perf_counter() - start,
        )

    def bucket_for(self, chunks: Sequence[SeqChunk]) -> GraphKey | None:
        """The graph that runs this step, or None when it must run eagerly (a chunk that does
        not attend as decodes, i.e. a prefill, or more rows than the largest bucket): the
        smallest bucket that holds the step's rows (one per token), at the smallest context
        bound >= its longest context."""
        if not chunks or not self.graphs:
            return None
        if any(len(c.token_ids) != 1 and not c.attend_as_decodes for c in chunks):
            return None
        rows = sum(len(c.token_ids) for c in chunks)
        if rows > self.max_batch_size:
            return None
        bs = next(s for s in self.sizes if s >= rows)
        longest = max(c.num_computed_tokens + len(c.token_ids) for c in chunks)
        bound = next((b for b in self.bounds[bs] if b >= longest), None)
        return None if bound is None else GraphKey(bs, bound)

    def _stage(self, chunks: Sequence[SeqChunk], bucket: int) -> tuple[int, int]:
        """Writes the step's inputs into the host staging buffers, one row per token in chunk
        order (the eager path's flat order); returns the rows in use and the block-table width
        in use. Rows past them are padding: slot -1, seq_len 0."""
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the previous step's copies have read the buffers
        bs = self.block_size
        tokens, tables = self._np_tokens, self._np_tables
        width = 1
        row = 0
        for c in chunks:
            start = c.num_computed_tokens
            # Every row of a chunk reads its request's table up to the chunk's last block.
            num_blocks = (start + len(c.token_ids) - 1) // bs + 1
            width = max(width, num_blocks)
            for j, token_id in enumerate(c.token_ids):
                pos = start + j
                tokens[0, row] = token_id
                tokens[1, row] = pos
                tokens[2, row] = c.block_ids[pos // bs] * bs + pos % bs
                self._np_seq_lens[row] = pos + 1  # a verified token attends as its decode
                # Entries past a row's last block are stale but never read (past its length).
                tables[row, :num_blocks] = c.block_ids[:num_blocks]
                row += 1
        tokens[0:2, row:bucket] = 0
        tokens[2, row:bucket] = -1
        self._np_seq_lens[row:bucket] = 0
        return row, width

    def run(self, chunks: Sequence[SeqChunk], key: GraphKey) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T rows (each chunk's tokens in turn, as the
        eager path lays them out: decodes one row each, a verification its last token's then
        its drafts').

        The result is a view of the graph's static output: read it before the next `run`.
        """
        bucket = key.batch_size
        rows, width = self._stage(chunks, bucket)
        self.token_inputs[:, :bucket].copy_(self.host_token_inputs[:, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(self.host_seq_lens[:bucket], non_blocking=True)
        self.block_tables[:rows, :width].copy_(
            self.host_block_tables[:rows, :width], non_blocking=True
        )
        if self._copies_done is not None:
            self._copies_done.record()
        replay, hidden = self.graphs[key]
        replay()
        return hidden[:rows]


def _ranges(sizes: Sequence[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
