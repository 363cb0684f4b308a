"""How a model's dimensions are split over tensor-parallel ranks.

Attention is split by KV-head group: a rank holds whole groups (its KV heads and the query heads
that read them), so attention never crosses ranks. Groups need not divide evenly: with 3 KV heads
over 2 ranks (SmolLM2-135M: 9 query heads) rank 0 holds 2 groups (6 query heads) and rank 1
holds 1 group (3). With fewer KV heads than ranks, each KV head is replicated on
`world_size // num_kv_heads` ranks, which then split its query heads evenly (vLLM's rule).
Everything else splits evenly or is a startup error; the vocabulary is padded instead.
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelSplitError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise TensorParallelSplitError(
            f"tensor parallelism: {what} ({total}) is not divisible by "
            f"--tensor-parallel-size {parts}"
        )
    return total // parts


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads) and KV
    heads [kv_start, kv_start + num_kv_heads) of the whole model."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def shard_heads(total_heads: int, total_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    if total_heads % total_kv_heads:
        raise TensorParallelSplitError(
            f"num_attention_heads ({total_heads}) must be a multiple of num_key_value_heads "
            f"({total_kv_heads})"
        )
    group = total_heads // total_kv_heads  # query heads per KV head
    if world_size == 1:
        return HeadShard(0, total_heads, 0, total_kv_heads)
    if total_kv_heads >= world_size:
        # Whole groups per rank, the first `extra` ranks one more.
        base, extra = divmod(total_kv_heads, world_size)
        kv_start = rank * base + min(rank, extra)
        num_kv = base + (rank < extra)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if world_size % total_kv_heads:
        raise TensorParallelSplitError(
            f"tensor parallelism: {total_kv_heads} KV heads cannot be spread over "
            f"--tensor-parallel-size {world_size} (with fewer KV heads than ranks, the size must "
            "be a multiple of the KV heads so each is replicated evenly)"
        )
    replicas = world_size // total_kv_heads
    per_rank = divide(total_heads, world_size, "num_attention_heads")
    return HeadShard(rank * per_rank, per_rank, rank // replicas, 1)


@dataclass(frozen=True, slots=True)
class VocabShard:
    """Rows [start, start + size) of the vocabulary, held in `padded_size` rows (the same on
    every rank, so logits gather evenly; rows past `size` are zeros)."""

    start: int
    size: int
    padded_size: int


def shard_vocab(vocab_size: int, world_size: int, rank: int) -> VocabShard:
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return VocabShard(start, min(per_rank, vocab_size - start), per_rank)
