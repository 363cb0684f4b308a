"""KV cache events in vLLM's format: what the prefix cache stored and evicted, for KV-aware routers.

Pure Python, no I/O: the KV cache manager reports each prefix-cache entry it registers
(`block_stored`) and evicts (`block_removed`) to a `KVEventRecorder`, which turns them into
vLLM's `BlockStored` / `BlockRemoved` events; the engine takes them once per step
(`take_events`) and hands them to the publisher (engine/kv_event_publisher.py).

Block hashes are vLLM's, so a consumer can compute them from token ids alone: the hash of full
block i is `sha256(cbor([parent, tokens of block i, None]))` (vLLM's `sha256_cbor`, CBOR in its
canonical form), where `parent` is block i - 1's hash and, for the first block, `NONE_HASH =
sha256(cbor(seed))` with seed "vllm-none-hash" (or PYTHONHASHSEED when set, as vLLM). Events
carry the hash as vLLM does by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the 32-byte digest
read big-endian, keeping its low 64 bits. Wick's own prefix cache keys blocks by Python's hash
and verifies tokens (kv_cache_manager.py); these hashes are only what the events say.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

# vLLM's medium for blocks in the accelerator's (here: the engine's) KV cache.
MEDIUM_GPU = "GPU"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head: major type and argument, in the shortest form (canonical CBOR)."""
    if value < 24:
        return bytes([major << 5 | value])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, value)
    raise ValueError(f"{value} does not fit a CBOR head")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of the values block hashes are made of: None, ints, str, bytes, and
    lists / tuples of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor_encode(value)).digest()


def none_hash() -> bytes:
    """The parent hash of every first block (vLLM's NONE_HASH for sha256_cbor)."""
    return sha256_cbor(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """vLLM's block hash of one full block (no extra keys: no LoRA, multimodal or salt)."""
    return sha256_cbor((parent, tuple(token_ids), None))


def external_hash(block_hash: bytes) -> int:
    """The hash as events carry it: the digest's low 64 bits."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the prefix cache: consecutive blocks of one prefix, the first one
    chained onto `parent_block_hash` (None: the sequence's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for new tokens)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache is empty (an engine that starts)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventRecorder:
    """Turns the KV cache manager's registrations and evictions into events (engine thread).

    `_hashes` maps each live prefix-cache entry (the manager's `cache_id`) to its block hash, so
    that a child is chained onto its parent and an eviction names what was stored.
    """

    block_size: int
    _none_hash: bytes = field(default_factory=none_hash)
    _hashes: dict[int, bytes] = field(default_factory=dict)
    _events: list[KVCacheEvent] = field(default_factory=lambda: [AllBlocksCleared()])

    def block_stored(
        self,
        cache_id: int,
        parent_cache_id: int | None,
        token_ids: Sequence[int],
        block_index: int,
    ) -> None:
        """Entry `cache_id` holds block `block_index` of `token_ids` (a request's tokens)."""
        bs = self.block_size
        parent = self._parent_hash(parent_cache_id, token_ids, block_index)
        block_tokens = list(token_ids[block_index * bs : (block_index + 1) * bs])
        block_hash = hash_block(parent, block_tokens)
        self._hashes[cache_id] = block_hash
        parent_external = None if block_index == 0 else external_hash(parent)
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and parent_external is not None
            and last.block_hashes[-1] == parent_external
        ):
            # The next block of the same prefix in the same step: one event, as vLLM's.
            last.block_hashes.append(external_hash(block_hash))
            last.token_ids.extend(block_tokens)
            return
        self._events.append(
            BlockStored([external_hash(block_hash)], parent_external, block_tokens, bs)
        )

    def block_removed(self, cache_id: int) -> None:
        block_hash = self._hashes.pop(cache_id)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_hash(block_hash)]))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> set[int]:
        """The external hashes of every entry in the prefix cache now."""
        return {external_hash(h) for h in self._hashes.values()}

    def _parent_hash(
        self, parent_cache_id: int | None, token_ids: Sequence[int], block_index: int
    ) -> bytes:
        if block_index == 0:
            return self._none_hash
        if parent_cache_id is not None and parent_cache_id in self._hashes:
            return self._hashes[parent_cache_id]
        # The parent entry was evicted since the request matched it: the hash depends only on
        # the tokens, so walk the prefix again.
        parent = self._none_hash
        bs = self.block_size
        for i in range(block_index):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
        return parent
