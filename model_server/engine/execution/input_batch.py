"""Flattening one step's scheduled work into the model's input tensors.

Kept apart from the model runner so kernels and model tests can build real batches without a
scheduler: a `SeqChunk` says which tokens of a sequence run this step and where its blocks are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from model_server.layers.attention.backend import AttentionMetadata


@dataclass(slots=True)
class SeqChunk:
    """The tokens of one sequence computed this step.

    `token_ids` are the new tokens at positions `[num_computed_tokens, num_computed_tokens +
    len(token_ids))`; `block_ids` must cover every position up to the end of the chunk.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    # The sliding-window group's block table (models with one; empty otherwise): it must cover
    # the chunk's own positions, entries before its window may be the null block.
    sliding_block_ids: Sequence[int] = field(default_factory=tuple)
    # Its queries attend one by one, each as the decode of its position would (speculative
    # verification: a row's attention then is that decode's, bit for bit; a chunk's tiled
    # attention sums in another order). See engine/spec_decode/row_invariance.py.
    attend_as_decodes: bool = False

    @property
    def num_attention_seqs(self) -> int:
        """The sequences it is in the attention metadata: one per query when it attends as
        decodes, else one."""
        return len(self.token_ids) if self.attend_as_decodes else 1


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # [B] int64: flat index of each sequence's last token (where its next-token logits come from).
    last_token_indices: torch.Tensor
    # Batch order -> index in the caller's list (decodes are moved first).
    order: list[int]


def _attends_as_decodes(chunk: SeqChunk) -> bool:
    return len(chunk.token_ids) == 1 or chunk.attend_as_decodes


def decode_first_order(chunks: Sequence[SeqChunk]) -> list[int]:
    """Indices of `chunks` with single-token chunks (and those attending as decodes) first,
    each group in its original order."""
    decodes = [i for i, c in enumerate(chunks) if _attends_as_decodes(c)]
    prefills = [i for i, c in enumerate(chunks) if not _attends_as_decodes(c)]
    return decodes + prefills


def build_model_inputs(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu"
) -> ModelInputs:
    """Build flat inputs for `chunks`, reordered decodes first (see AttentionMetadata). A chunk
    that attends as decodes is that many one-query sequences in the attention metadata (the
    same block table row each), counted among the decodes."""
    order = decode_first_order(chunks)
    num_decodes = sum(c.num_attention_seqs for c in chunks if _attends_as_decodes(c))
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    last_tokens: list[int] = []
    tables: list[Sequence[int]] = []
    max_blocks = 1
    for idx in order:
        c = chunks[idx]
        start = c.num_computed_tokens
        end = start + len(c.token_ids)
        if len(c.block_ids) * block_size < end:
            raise ValueError(
                f"block table of {len(c.block_ids)} blocks cannot hold {end} tokens "
                f"(block_size {block_size})"
            )
        input_ids.extend(c.token_ids)
        positions.extend(range(start, end))
        bids = c.block_ids
        slots.extend(bids[p // block_size] * block_size + p % block_size for p in range(start, end))
        if c.attend_as_decodes:
            query_start_loc.extend(
                range(query_start_loc[-1] + 1, query_start_loc[-1] + end - start + 1)
            )
            seq_lens.extend(range(start + 1, end + 1))
            tables.extend([bids] * (end - start))
        else:
            query_start_loc.append(query_start_loc[-1] + end - start)
            seq_lens.append(end)
            tables.append(bids)
        last_tokens.append(query_start_loc[-1] - 1)
        max_blocks = max(max_blocks, -(-end // block_size))
    block_tables = _block_tables(tables, max_blocks)
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_start_loc=qsl.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        num_decodes=num_decodes,
        max_query_len=max(
            query_start_loc[i + 1] - query_start_loc[i] for i in range(len(query_start_loc) - 1)
        ),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    if any(c.sliding_block_ids for c in chunks):
        # The sliding-window group: the same tokens, slots in its own pool.
        sliding_tables: list[Sequence[int]] = []
        sliding_slots = []
        for idx in order:
            c = chunks[idx]
            table = c.sliding_block_ids
            sliding_tables.extend([table] * c.num_attention_seqs)
            start = c.num_computed_tokens
            for p in range(start, start + len(c.token_ids)):
                sliding_slots.append(table[p // block_size] * block_size + p % block_size)
        metadata.sliding = replace(
            metadata,
            slot_mapping=torch.tensor(sliding_slots, dtype=torch.int64).to(device),
            block_tables=_block_tables(sliding_tables, max_blocks).to(device),
        )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True),
        attn_metadata=metadata,
        last_token_indices=torch.tensor(last_tokens, dtype=torch.int64).to(
            device, non_blocking=True
        ),
        order=order,
    )


def _block_tables(tables: Sequence[Sequence[int]], max_blocks: int) -> torch.Tensor:
    """[B, max_blocks] int32, zero-padded."""
    out = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
    for row, bids in enumerate(tables):
        bids = bids[:max_blocks]
        if bids:
            out[row, : len(bids)] = torch.tensor(bids, dtype=torch.int32)
    return out
