"""Decode steps replayed from device graphs (CUDA graphs), one graph per batch-size bucket.

Why: at small batches a decode step's GPU work takes a few milliseconds, and eager PyTorch
spends as long again launching ~15 kernels per layer from Python. A replay launches the whole
forward at once.

What is captured: the model's forward (embedding to final norm) for `bs` requests with one new
token each, reading its inputs from static device buffers and writing hidden states [bs, hidden]
into a static output. The LM head and the sampler stay eager and run on the real rows only.

Padding: a step of B decodes replays the smallest bucket >= B. Rows B.. get slot -1 (the KV
store skips them) and seq_len 0 (attention reads nothing and returns zeros); their hidden rows
are never read.

Host values baked into a graph: num_decodes = bs and the context-length bound max_model_len
(`seq_lens_cpu`/`max_seq_len` of the captured metadata, which graph-capable backends use only as
bounds; the kernels read the real lengths from `seq_lens`). Only backends whose class sets
`supports_graphs` are captured.

Invariants: the KV cache is allocated before capture and never reallocated (graphs hold its
addresses); graphs are captured largest first into one shared memory pool, so the smaller ones
reuse its blocks; under tensor parallelism every rank captures the same buckets in the same
order and replays the same bucket each step (the choice depends only on the step's chunks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

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


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Buckets 1, 2, 4, then multiples of 8, up to the first that holds min(max_num_seqs,
    max_capture_size) requests (so every decode batch the scheduler can form up to that bound
    has a bucket)."""
    limit = max(1, min(max_num_seqs, max_capture_size))
    sizes: list[int] = []
    for size in [1, 2, 4, *range(8, limit + 8, 8)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


class CUDAGraphRunner:
    """Captures `forward` per bucket and runs eligible decode steps through the graphs."""

    def __init__(
        self,
        forward: ForwardFn,
        capturer: GraphCapturer,
        *,
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.capturer = capturer
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        max_bs = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Rows: input_ids, positions, slot_mapping (one int64 host-to-device copy per step).
        self.token_inputs = torch.zeros((3, max_bs), dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_bs, self.max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # bucket -> (replay, static hidden states [bucket, hidden])
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.token_inputs[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[self.max_model_len] * bs,  # bounds, see the module docstring
        )

    def capture(self) -> None:
        """Capture every bucket, largest first. Static inputs hold padding rows only, so the
        warm-up and capture runs write nothing to the KV cache."""
        start = time.perf_counter()
        self.token_inputs[0:2].zero_()
        self.token_inputs[2].fill_(-1)
        self.seq_lens.zero_()
        self.block_tables.zero_()
        for bs in reversed(self.sizes):
            metadata = self._metadata(bs)
            ids, positions = self.token_inputs[0, :bs], self.token_inputs[1, :bs]

            def run(ids=ids, positions=positions, metadata=metadata) -> torch.Tensor:
                return self.forward(ids, positions, metadata)

            run()  # warm-up: JIT compiles, library handles and workspaces outside the capture
            self.graphs[bs] = self.capturer.capture(run)
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            _ranges(self.sizes),
            time.perf_counter() - start,
        )

    def bucket_for(self, chunks: Sequence[SeqChunk]) -> int | None:
        """The bucket that runs this step, or None when it must run eagerly (a prefill chunk
        in the batch, or more requests than the largest bucket)."""
        if not chunks or len(chunks) > self.max_batch_size or not self.graphs:
            return None
        if any(len(c.token_ids) != 1 for c in chunks):
            return None
        return next(s for s in self.sizes if s >= len(chunks))

    def run(self, chunks: Sequence[SeqChunk], bucket: int) -> torch.Tensor:
        """Hidden states [len(chunks), hidden] of a decode-only step (row i: chunks[i]).

        The result is a view of the graph's static output: read it before the next `run`.
        """
        num_reqs = len(chunks)
        pad = bucket - num_reqs
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[Sequence[int]] = []
        for c in chunks:
            pos = c.num_computed_tokens
            ids.append(c.token_ids[0])
            positions.append(pos)
            slots.append(c.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            rows.append(c.block_ids[: pos // bs + 1])
        width = max(len(r) for r in rows)
        rows.extend([()] * pad)
        tables = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.int64
        )
        self.token_inputs[:, :bucket].copy_(host, non_blocking=True)
        self.seq_lens[:bucket].copy_(
            torch.tensor(seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True
        )
        # Entries past a row's last block are stale but never read (they lie past its length).
        self.block_tables[:bucket, :width].copy_(tables, non_blocking=True)
        replay, hidden = self.graphs[bucket]
        replay()
        return hidden[:num_reqs]


def _ranges(sizes: Sequence[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
