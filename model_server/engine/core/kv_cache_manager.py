"""Paged KV cache bookkeeping: a block pool with reference counts and a chained-hash prefix cache.

Pure Python: this module decides which block ids hold which tokens; the model runner owns the
tensors. Token i of a request lives in block `request.block_ids[i // block_size]`, at offset
`i % block_size` (its slot is `block_id * block_size + i % block_size`).

Block states (every block is in exactly one):
  - in use: `ref_cnt > 0`, listed in the block table of `ref_cnt` requests;
  - cached free: `ref_cnt == 0` and `block_hash is not None`: still findable by a prefix-cache hit,
    evictable, kept in LRU order (least recently freed first);
  - plain free: `ref_cnt == 0` and `block_hash is None`: holds nothing worth keeping.
A fresh block is taken from the plain free blocks first and only then by evicting the least
recently freed cached block, so cached prefixes survive as long as possible.

Prefix caching: the hash of a request's full block i is
`hash_block_tokens(block_hashes[i - 1] or None, tokens of block i)`, so a hash names the whole
prefix, not only the block. Hashes are only probabilistically unique, so a cached block also keeps
its tokens and the id of the cache entry it was computed after (`parent_cache_id`); a lookup accepts
a block only when its tokens are equal and its parent entry is the block matched just before. By
induction a hit chain is exactly a chain of blocks computed after the same token prefix, whatever
the hash function does. A LoRA request's blocks also carry its adapter's key (`prefix_key`),
which a lookup must match: two adapters never share KV blocks (their K/V differ).

KV cache groups (vLLM's hybrid KV cache manager, reduced to two groups): a model whose layers mix
full attention and a sliding window W (Gemma 2/3), or that slides on every layer (Phi-3), keeps
the sliding layers' K/V in a second block pool (`SlidingWindowSpec`) with its own block table per
request, `request.sliding_block_ids`. Entry i covers the same tokens as `block_ids[i]`, but once
a request's next query position c makes block i useless (all its tokens before c - W + 1) the
block is freed and the entry becomes `NULL_BLOCK` (block 0 of that pool, never handed out and
never written). So a sliding layer holds about W / block_size blocks per request whatever the
context length. The full-attention pool and prefix cache work as without groups; the sliding
pool caches its full blocks too (`_SlidingBlockPool`), and a prefix hit is taken only as far as
the sliding blocks in the window before its end are still cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from model_server.engine.core.kv_events import KVEventRecorder
from model_server.engine.core.request import Request


def hash_block_tokens(parent_block_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: it depends on every token before it through the parent."""
    return hash((parent_block_hash, tuple(token_ids)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The sliding pool's placeholder for freed (out-of-window) entries of a block table.
NULL_BLOCK = 0


@dataclass(slots=True, frozen=True)
class SlidingWindowSpec:
    """The sliding-window KV cache group: its pool size (block 0 is the null block, so
    `num_blocks - 1` are usable) and its window in tokens."""

    num_blocks: int
    sliding_window: int


class _SlidingBlockPool:
    """Block ids of the sliding-window group, with its own prefix cache.

    A sliding block full of a request's tokens is registered under the `cache_id` of the
    full-group cache entry for the same block index of the same request: that id names the whole
    token prefix (full-group entries are verified chains, and ids are never reused), so a
    full-group hit chain tells exactly which sliding blocks hold the same K/V. Unheld registered
    blocks stay findable in LRU order until a fresh block is needed and none is plain free.
    """

    def __init__(self, spec: SlidingWindowSpec, block_size: int) -> None:
        if spec.num_blocks < 2:
            raise ValueError(f"the sliding-window pool needs at least 2 blocks, got {spec}")
        self.num_blocks = spec.num_blocks
        self.window = spec.sliding_window
        self.block_size = block_size
        self.ref_cnt = [0] * spec.num_blocks
        self.free_ids: deque[int] = deque(range(1, spec.num_blocks))
        # full-group cache_id -> sliding block id, and back; unheld ones in LRU order.
        self.cached: dict[int, int] = {}
        self.cache_key: dict[int, int] = {}
        self.free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.free_cached)

    def num_skipped(self, first_query_pos: int) -> int:
        """Leading blocks no query at `first_query_pos` or later can see (all their tokens are
        before first_query_pos - W + 1)."""
        return max(0, first_query_pos - self.window + 1) // self.block_size

    def release(self, block_id: int) -> None:
        if block_id == NULL_BLOCK:
            return
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            if block_id in self.cache_key:
                self.free_cached[block_id] = None
            else:
                self.free_ids.append(block_id)

    def touch(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            del self.free_cached[block_id]
        self.ref_cnt[block_id] += 1

    def register(self, block_id: int, full_cache_id: int) -> None:
        """Block `block_id` holds the K/V of the prefix named by a full-group cache entry."""
        if block_id == NULL_BLOCK or block_id in self.cache_key or full_cache_id in self.cached:
            return
        self.cached[full_cache_id] = block_id
        self.cache_key[block_id] = full_cache_id

    def hits(self, full_cache_ids: Sequence[int]) -> int:
        """The longest k <= len(full_cache_ids) such that the sliding blocks a query at
        position k * block_size needs (indices [num_skipped(k * bs), k)) are all cached."""
        for k in range(len(full_cache_ids), 0, -1):
            start = self.num_skipped(k * self.block_size)
            if all(full_cache_ids[i] in self.cached for i in range(start, k)):
                return k
        return 0

    def num_hits_free(self, full_cache_ids: Sequence[int]) -> int:
        """How many of the cached blocks a hit of len(full_cache_ids) blocks takes are unheld
        (taking them uses free blocks too)."""
        k = len(full_cache_ids)
        start = self.num_skipped(k * self.block_size)
        return sum(1 for i in range(start, k) if self.ref_cnt[self.cached[full_cache_ids[i]]] == 0)

    def take_hits(self, table: list[int], full_cache_ids: Sequence[int]) -> None:
        """Start an empty `table` with a hit: null entries, then the cached window blocks."""
        k = len(full_cache_ids)
        start = self.num_skipped(k * self.block_size)
        for i in range(k):
            if i < start:
                table.append(NULL_BLOCK)
            else:
                block_id = self.cached[full_cache_ids[i]]
                self.touch(block_id)
                table.append(block_id)

    def free_skipped(self, table: list[int], first_query_pos: int) -> None:
        """Free the entries of `table` that fell out of the window, leaving NULL_BLOCK."""
        for i in range(min(self.num_skipped(first_query_pos), len(table))):
            if table[i] != NULL_BLOCK:
                self.release(table[i])
                table[i] = NULL_BLOCK

    def num_needed(self, table: list[int], first_query_pos: int, num_required: int) -> int:
        """Fresh blocks to extend `table` to `num_required` entries (skipped ones stay null)."""
        start = max(len(table), self.num_skipped(first_query_pos))
        return max(0, num_required - start)

    def extend(self, table: list[int], first_query_pos: int, num_required: int) -> None:
        skipped = self.num_skipped(first_query_pos)
        for i in range(len(table), num_required):
            table.append(NULL_BLOCK if i < skipped else self._pop_fresh())

    def _pop_fresh(self) -> int:
        """A plain free block, else the least recently freed cached one (unregistered)."""
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            del self.cached[self.cache_key.pop(block_id)]
        self.ref_cnt[block_id] = 1
        return block_id


@dataclass(slots=True)
class Block:
    """One KV cache block of `block_size` token slots.

    Invariants:
      - `block_hash is not None` iff this block is the entry for that hash in the prefix-cache map
        (a duplicate computed by another request is never registered, it stays plain);
      - then `token_ids` holds its tokens and `cache_id` a number never given to another entry, and
        `parent_cache_id` is the `cache_id` of the entry for the previous block (None for a first
        block). Eviction clears all four, so a reused block can never vouch for stale children.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    cache_id: int | None = None
    parent_cache_id: int | None = None
    # The LoRA adapter the entry's K/V were computed with (Request.prefix_cache_key; None: the
    # base model): a lookup accepts it only for a request with the same key.
    prefix_key: tuple[str, int] | None = None

    def clear_cache_entry(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.cache_id = None
        self.parent_cache_id = None
        self.prefix_key = None


@dataclass(slots=True)
class _CacheCursor:
    """How far `cache_blocks` got through one request's blocks.

    `parent_cache_id` is the cache entry whose prefix equals the request's blocks
    `[0, num_blocks)` (None at the start). `broken` means one of those blocks collided with a
    different cached block, so no later block of this request can be tied to a cached chain.
    """

    num_blocks: int = 0
    parent_cache_id: int | None = None
    broken: bool = False


class KVCacheManager:
    """Owns the block pool: hands out block ids to requests, shares them through the prefix cache.

    The scheduler drives it: `get_computed_blocks` + `allocate_slots` when a request is scheduled
    from the waiting queue, `allocate_slots` again for each later step, `cache_blocks` after the
    step's tokens are computed, `free` when the request finishes or is preempted, and `fork` to
    share a prompt between the n > 1 samples of one request.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding: SlidingWindowSpec | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The sliding-window group's pool, when the model has one (see the module docstring).
        self.sliding = None if sliding is None else _SlidingBlockPool(sliding, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))
        # Keys only; insertion order is LRU order (front = least recently freed = evicted first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, Block] = {}
        self._cursors: dict[str, _CacheCursor] = {}
        self._next_cache_id = 0
        # Prefix-cache metrics, in tokens, counted once per scheduling of a request from waiting.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Told of every entry registered and evicted when KV events are on (--kv-events-config).
        self.kv_events: KVEventRecorder | None = None

    # ----------------------------------------------------------------------------------- stats

    @property
    def num_free_blocks(self) -> int:
        """Blocks that a new allocation may take (plain free plus evictable cached)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request, in [0, 1]; cached free blocks count as free.
        With a sliding-window group, the fuller of the two pools."""
        usage = 1.0 - self.num_free_blocks / self.num_blocks
        if self.sliding is not None:
            sliding = 1.0 - self.sliding.num_free_blocks / (self.sliding.num_blocks - 1)
            usage = max(usage, sliding)
        return usage

    @property
    def num_free_sliding_blocks(self) -> int | None:
        """Free blocks of the sliding-window pool (None without one)."""
        return None if self.sliding is None else self.sliding.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request whose block table covers `num_tokens` tokens fits in the whole pool."""
        return self.num_blocks_for(num_tokens) <= self.num_blocks

    # ---------------------------------------------------------------------------- allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Prefix-cache lookup for a request about to be scheduled from the waiting queue.

        Returns the ids of the cached blocks holding the longest cached prefix of
        `request.all_token_ids` and the number of tokens they hold (a multiple of block_size).
        At least one token is always left to compute, so the request can be sampled: a fully
        cached request gets its last block dropped. Takes no ownership and counts nothing: the
        result is only valid until the next allocation, so pass it straight to `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        bs = self.block_size
        tokens = request.all_token_ids
        hit_ids: list[int] = []
        parent_cache_id: int | None = None
        key = request.prefix_cache_key
        for i in range(max_blocks):
            block = self._hash_to_block.get(request.block_hashes[i])
            if (
                block is None
                or block.parent_cache_id != parent_cache_id
                or block.prefix_key != key
                or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break
            hit_ids.append(block.block_id)
            parent_cache_id = block.cache_id
        if self.sliding is not None and hit_ids:
            # Only as far as the sliding blocks of the window before the hit's end are cached.
            hit_ids = hit_ids[: self.sliding.hits(self._cache_ids(hit_ids))]
        return hit_ids, len(hit_ids) * bs

    def _cache_ids(self, block_ids: Sequence[int]) -> list[int]:
        """The cache ids of full-group blocks that are cache entries."""
        return [self.blocks[b].cache_id for b in block_ids]  # type: ignore[misc]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] | None = None,
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Grow `request.block_ids` to cover `num_computed_tokens + num_new_tokens` tokens.

        First scheduling (the block table is empty): pass the result of `get_computed_blocks` as
        `computed_block_ids` / `num_computed_tokens`; those blocks are taken (ref_cnt + 1, out of
        the free queue) and the prefix-cache counters are updated. Later steps pass neither and
        `request.num_computed_tokens` is used. Returns False and changes nothing when the free
        blocks do not suffice. Never changes `request.num_computed_tokens` (the scheduler does).
        """
        first_scheduling = computed_block_ids is not None
        if computed_block_ids is not None:
            if request.block_ids:
                raise ValueError(
                    f"request {request.request_id} already has blocks; computed blocks are only "
                    "taken when it is first scheduled"
                )
            if num_computed_tokens is None:
                num_computed_tokens = len(computed_block_ids) * self.block_size
        else:
            computed_block_ids = ()
            if num_computed_tokens is None:
                num_computed_tokens = request.num_computed_tokens
        num_required = self.num_blocks_for(num_computed_tokens + num_new_tokens)
        num_fresh = max(0, num_required - len(request.block_ids) - len(computed_block_ids))
        # Computed blocks nobody holds sit in the free queue: taking them uses free blocks too.
        num_computed_free = sum(1 for b in computed_block_ids if self.blocks[b].ref_cnt == 0)
        if num_fresh + num_computed_free > self.num_free_blocks:
            return False
        sliding = self.sliding
        if sliding is not None:
            # Blocks behind the window are released first: they are dead whatever happens next.
            sliding.free_skipped(request.sliding_block_ids, num_computed_tokens)
            hit_cache_ids = self._cache_ids(computed_block_ids)
            needed = sliding.num_hits_free(hit_cache_ids)
            if hit_cache_ids:
                needed += num_required - len(computed_block_ids)
            else:
                needed += sliding.num_needed(
                    request.sliding_block_ids, num_computed_tokens, num_required
                )
            if needed > sliding.num_free_blocks:
                return False
            if hit_cache_ids:
                sliding.take_hits(request.sliding_block_ids, hit_cache_ids)
            sliding.extend(request.sliding_block_ids, num_computed_tokens, num_required)

        if first_scheduling and self.enable_prefix_caching:
            # Counted here, not in the lookup: a waiting request may be looked up every step.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_tokens
        for block_id in computed_block_ids:
            self._touch(self.blocks[block_id])
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(self._pop_fresh_block() for _ in range(num_fresh))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_computed_tokens`
        tokens in the prefix cache (no-op when prefix caching is off).

        Call after a step computed the tokens' K/V. A block whose hash already names another
        cached block is left unregistered: if that block holds the same tokens after the same
        prefix it is an equivalent duplicate and later blocks chain onto it; otherwise (a hash
        collision) none of this request's later blocks are registered.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        cursor = self._cursors.setdefault(request.request_id, _CacheCursor())
        if num_full <= cursor.num_blocks:
            return
        self._update_block_hashes(request, num_full)
        bs = self.block_size
        for i in range(cursor.num_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is not None:
                # Taken from the cache or shared by fork: already an entry for this exact prefix.
                cursor.parent_cache_id = block.cache_id
                self._register_sliding(request, i, block.cache_id)
                continue
            if cursor.broken:
                continue
            block_hash = request.block_hashes[i]
            token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            entry = self._hash_to_block.get(block_hash)
            if entry is None:
                block.block_hash = block_hash
                block.token_ids = token_ids
                block.cache_id = self._next_cache_id
                block.parent_cache_id = cursor.parent_cache_id
                block.prefix_key = request.prefix_cache_key
                self._next_cache_id += 1
                self._hash_to_block[block_hash] = block
                cursor.parent_cache_id = block.cache_id
                if self.kv_events is not None:
                    self.kv_events.block_stored(
                        block.cache_id, block.parent_cache_id, request.all_token_ids, i
                    )
            elif (
                entry.token_ids == token_ids
                and entry.parent_cache_id == cursor.parent_cache_id
                and entry.prefix_key == request.prefix_cache_key
            ):
                cursor.parent_cache_id = entry.cache_id
            else:
                cursor.broken = True
                continue
            self._register_sliding(request, i, cursor.parent_cache_id)
        cursor.num_blocks = num_full

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks and empty its block table (idempotent).

        Blocks are released tail first, so with LRU eviction a request's last blocks are evicted
        before its first ones (a shorter prefix is more likely to be shared). `block_hashes` stay:
        they depend only on the tokens and are reused if the request is scheduled again.
        """
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)
        request.block_ids = []
        self._cursors.pop(request.request_id, None)
        if self.sliding is not None:
            for block_id in reversed(request.sliding_block_ids):
                self.sliding.release(block_id)
            request.sliding_block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` tokens (speculative
        decoding: the slots of rejected drafts). Those blocks were allocated fresh for this
        step's drafts and hold no token the request keeps, so none is shared or cached; a
        partly valid block stays, its rejected slots are overwritten by later steps before
        `cache_blocks` can register it (it registers only blocks full of computed tokens)."""
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise AssertionError(f"block {block_id} past the accepted tokens is shared")
            block.ref_cnt = 0
            self._free_plain.append(block_id)
        del request.block_ids[keep:]
        if self.sliding is not None:
            table = request.sliding_block_ids
            for block_id in reversed(table[keep:]):
                self.sliding.release(block_id)
            del table[keep:]

    def fork(self, parent: Request, child: Request) -> int:
        """Share the parent's full prompt blocks with a sibling sample (n > 1), prefix cache or not.

        Valid only when the parent's prompt is computed (`parent.num_computed_tokens >=
        parent.num_prompt_tokens`), the child has the same prompt and no blocks yet. The child
        gets the blocks that are full of prompt tokens, leaving at least one prompt token to
        compute (the partly filled block is the parent's to write into). Sets and returns
        `child.num_computed_tokens`. Undo with `free(child)`.
        """
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"cannot fork {parent.request_id}: its prompt is not computed yet")
        if child.block_ids:
            raise ValueError(f"cannot fork into {child.request_id}: it already has blocks")
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError(f"cannot fork into {child.request_id}: its prompt differs")
        num_shared = (parent.num_prompt_tokens - 1) // self.block_size
        if self.sliding is not None:
            # The child's first query needs the window before it: if the parent already freed
            # part of it (it decoded past the prompt), nothing is shared.
            window_start = self.sliding.num_skipped(num_shared * self.block_size)
            if NULL_BLOCK in parent.sliding_block_ids[window_start:num_shared]:
                num_shared = 0
        for block_id in parent.block_ids[:num_shared]:
            self.blocks[block_id].ref_cnt += 1
        child.block_ids = list(parent.block_ids[:num_shared])
        if self.sliding is not None:
            shared = parent.sliding_block_ids[:num_shared]
            for block_id in shared:
                if block_id != NULL_BLOCK:
                    self.sliding.ref_cnt[block_id] += 1
            child.sliding_block_ids = list(shared)
        child.num_computed_tokens = num_shared * self.block_size
        return child.num_computed_tokens

    # ------------------------------------------------------------------------------ internals

    def _update_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend `request.block_hashes` to cover its first `num_blocks` (full) blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        # A LoRA request's chain starts from its adapter's key (the base model's from None),
        # so adapters' blocks hash apart; lookups check the key too (Block.prefix_key).
        root = None if request.prefix_cache_key is None else hash(request.prefix_cache_key)
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i > 0 else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def _register_sliding(self, request: Request, i: int, full_cache_id: int | None) -> None:
        """The request's sliding block i (if still held) has the K/V of the prefix named by the
        full-group entry `full_cache_id`."""
        table = request.sliding_block_ids
        if self.sliding is not None and full_cache_id is not None and i < len(table):
            self.sliding.register(table[i], full_cache_id)

    def _touch(self, block: Block) -> None:
        """Take a reference on a block found in the cache (out of the free queue if unheld)."""
        if block.ref_cnt == 0:
            del self._free_cached[block.block_id]
        block.ref_cnt += 1

    def _pop_fresh_block(self) -> int:
        """Take a free block for new tokens: a plain one, else evict the LRU cached one."""
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            del self._hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.block_removed(block.cache_id)  # type: ignore[arg-type]
            block.clear_cache_entry()
        self.blocks[block_id].ref_cnt = 1
        return block_id
