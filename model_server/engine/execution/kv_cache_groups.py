"""Which layers keep their K/V in which block pool, and how a memory budget splits between pools.

Layers attending within a sliding window shorter than `max_model_len` form the sliding group:
their caches come from a pool of their own (block 0 is the null block), sized for the windows of
the most requests a step can run, not for whole contexts (KVCacheManager frees the blocks that
leave the window). Every other layer is in the full group. Pure arithmetic, no torch.

Pool sizes: with N full-group blocks (the engine's `num_blocks`), the sliding pool has
M = min(cap, N + 1) blocks, where cap bounds what the scheduler can hold at once: each of the
`max_num_seqs` requests holds its window plus the block being filled (cdiv(W, bs) + 2 blocks), and
one step's chunks add at most cdiv(max_num_batched_tokens, bs) more; +1 for the null block. A
sliding entry always pairs with a full-group entry, so N + 1 blocks never run out first.
When no layer is in the full group (Phi-3 slides everywhere), its block ids cost no memory: N is
the context of `max_num_seqs` full-length requests, and the budget goes to the sliding pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class KVCacheGroups:
    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    # The window the sliding pool keeps (the largest of its layers'); None without the group.
    sliding_window: int | None
    # The most sliding blocks the scheduler can hold at once, the null block included.
    sliding_cap: int
    # Full-group block ids to hand out when that group has no layers.
    virtual_full_blocks: int

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding_layers)

    def sliding_num_blocks(self, num_blocks: int) -> int:
        """Blocks of the sliding pool that go with `num_blocks` full-group blocks."""
        return min(self.sliding_cap, num_blocks + 1)

    def cache_bytes(self, num_blocks: int, layer_block_bytes: int) -> int:
        """Bytes of every layer's cache for `num_blocks` full-group blocks (`layer_block_bytes`:
        one block of one layer, K and V)."""
        sliding = self.sliding_num_blocks(num_blocks) if self.hybrid else 0
        full = num_blocks * len(self.full_layers)
        return (full + sliding * len(self.sliding_layers)) * layer_block_bytes

    def num_blocks_for_budget(self, budget: int, layer_block_bytes: int) -> int:
        """The largest N whose caches (`cache_bytes`) fit in `budget` bytes (0 if none)."""
        p = layer_block_bytes
        num_full, num_sliding = len(self.full_layers), len(self.sliding_layers)
        if not self.hybrid:
            return budget // (num_full * p)
        if num_full == 0:
            if budget >= self.sliding_cap * num_sliding * p:
                return max(self.virtual_full_blocks, self.sliding_cap - 1)
            return max(0, budget // (num_sliding * p) - 1)
        rich = (budget - self.sliding_cap * num_sliding * p) // (num_full * p)
        if rich + 1 >= self.sliding_cap:
            return rich
        return max(0, (budget - num_sliding * p) // ((num_full + num_sliding) * p))


def kv_cache_groups(
    layer_windows: Sequence[int | None],
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> KVCacheGroups:
    """Group the layers by their windows (None: full attention). A window that the context
    cannot exceed changes nothing, so such layers stay in the full group."""
    sliding = [i for i, w in enumerate(layer_windows) if w is not None and w < max_model_len]
    full = [i for i in range(len(layer_windows)) if i not in set(sliding)]
    window = max((layer_windows[i] or 0) for i in sliding) if sliding else None
    cap = 0
    if window is not None:
        per_request = cdiv(window, block_size) + 2
        cap = max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size) + 1
    return KVCacheGroups(
        full_layers=tuple(full),
        sliding_layers=tuple(sliding),
        sliding_window=window,
        sliding_cap=cap,
        virtual_full_blocks=max_num_seqs * cdiv(max_model_len, block_size),
    )
