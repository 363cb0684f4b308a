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


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # [B] int64: flat index of each sequence's last token (where its next-token logits come from).
    last_token_indices: torch.Tensor
    # Batch order -> index in the caller's list (decodes are moved first).
    order: list[int]


def decode_first_order(chunks: Sequence[SeqChunk]) -> list[int]:
    """Indices of `chunks` with single-token chunks first, each group in its original order."""
    decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
    return decodes + prefills


def build_model_inputs(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu"
) -> ModelInputs:
    """Build flat inputs for `chunks`, reordered decodes first (see AttentionMetadata)."""
    order = decode_first_order(chunks)
    num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
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
        query_start_loc.append(query_start_loc[-1] + end - start)
        seq_lens.append(end)
        max_blocks = max(max_blocks, -(-end // block_size))
    block_tables = _block_tables([chunks[idx].block_ids for idx in order], max_blocks)
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        query_start_loc=qsl.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        num_decodes=num_decodes,
        max_query_len=max(query_start_loc[i + 1] - query_start_loc[i] for i in range(len(order))),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    if any(c.sliding_block_ids for c in chunks):
        # The sliding-window group: the same tokens, slots in its own pool.
        tables = [chunks[idx].sliding_block_ids for idx in order]
        sliding_slots = []
        for idx, table in zip(order, tables, strict=True):
            c = chunks[idx]
            start = c.num_computed_tokens
            for p in range(start, start + len(c.token_ids)):
                sliding_slots.append(table[p // block_size] * block_size + p % block_size)
        metadata.sliding = replace(
            metadata,
            slot_mapping=torch.tensor(sliding_slots, dtype=torch.int64).to(device),
            block_tables=_block_tables(tables, max_blocks).to(device),
        )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True),
        attn_metadata=metadata,
        last_token_indices=(qsl[1:].to(torch.int64) - 1).to(device, non_blocking=True),
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
