"""Sizing the KV cache from a profiled forward pass and `--gpu-memory-utilization` (as vLLM v1).

On a platform that can profile memory (`Platform.can_profile_memory()`), each rank runs the
largest step the scheduler can issue once, before the KV cache exists, and measures:

  - weights:         torch memory in use before the profile (weights and persistent buffers);
  - activation peak: torch's peak during the profile above that (the forward, LM head, sampler);
  - non-torch:       device memory of this process outside torch's allocator (runtime context,
                     communicator buffers, kernel modules): (total - free) - torch reserved.

    KV cache budget = min(total * utilization, total - in use at start)
                      - (weights + activation peak + non-torch)

`utilization` is this server's share of each device, as in vLLM v1. "In use at start" is device
memory that was not ours before the weights loaded (`take_memory_snapshot` at that point: other
processes, and this process's own runtime context once created): it is neither charged to us nor
ours to take, so when less than the requested share was free at start the budget is capped at
what was free (with a warning) rather than refused. `ModelRunner.__init__` takes the snapshot.
Memory other processes take after it (two servers starting at once on one device) is seen as ours
too; start such servers one after the other.

A user's `--kv-cache-memory` skips all of this; platforms that cannot profile (CPU) use their
fixed `default_kv_cache_memory`.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

from model_server.config import EngineConfig
from model_server.engine.core.request import Request
from model_server.engine.core.scheduler import SchedulerConfig
from model_server.engine.execution.input_batch import SeqChunk
from model_server.platforms import Platform
from model_server.sampling_params import MAX_LOGPROBS, SamplingParams

_GiB = 1024**3
_MiB = 1024**2

# Sampling settings of the profile's rows, chosen for the sampler's largest working set: a flat
# distribution (huge temperature) puts the top-p nucleus past the capped columns, so the sampler
# sorts the whole vocabulary; logprobs and a repetition penalty add their [rows, vocab] tensors.
_PROFILE_SAMPLING = SamplingParams(
    max_tokens=1,
    temperature=1e6,
    top_p=0.9,
    repetition_penalty=1.1,
    logprobs=MAX_LOGPROBS,
)


def _gib(n: int | float) -> str:
    return f"{n / _GiB:.2f} GiB"


@dataclass(slots=True)
class MemorySnapshot:
    """Device memory at one moment, in bytes."""

    free: int
    total: int
    torch_reserved: int  # held by torch's caching allocator (allocated + cached)

    @property
    def non_torch(self) -> int:
        """Used memory that torch's allocator does not hold (others' and runtime memory)."""
        return max(0, self.total - self.free - self.torch_reserved)


def take_memory_snapshot(platform: Platform) -> MemorySnapshot | None:
    """Where the platform can profile memory, its memory now; None elsewhere."""
    if not platform.can_profile_memory():
        return None
    free, total = platform.mem_get_info()
    return MemorySnapshot(free=free, total=total, torch_reserved=platform.memory_reserved())


@dataclass(slots=True)
class MemoryProfile:
    """One rank's memory budget, in bytes (see the module docstring for the formula)."""

    total: int
    utilization: float
    weights: int
    activation_peak: int
    non_torch: int
    in_use_at_start: int = 0  # not ours: in use before the weights loaded

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def usable(self) -> int:
        """The requested share, capped at what was free when the engine started."""
        return min(self.requested, self.total - self.in_use_at_start)

    @property
    def capped(self) -> bool:
        return self.usable < self.requested

    @property
    def non_kv(self) -> int:
        return self.weights + self.activation_peak + self.non_torch

    @property
    def kv_cache_memory(self) -> int:
        """Bytes left for the KV cache; negative when the rest does not even fit."""
        return self.usable - self.non_kv

    def breakdown(self) -> str:
        share = f"{_gib(self.total)} total x {self.utilization:.2f} = {_gib(self.requested)}"
        if self.capped:
            share += (
                f", capped at the {_gib(self.usable)} free at start "
                f"({_gib(self.in_use_at_start)} was already in use)"
            )
        return (
            f"{share}; weights {_gib(self.weights)}, activation peak "
            f"{_gib(self.activation_peak)}, non-torch {_gib(self.non_torch)}"
        )

    def __str__(self) -> str:
        return f"memory profile: {self.breakdown()}; KV cache {_gib(self.kv_cache_memory)}"


def profile_memory(
    platform: Platform,
    run: Callable[[], None],
    baseline: MemorySnapshot,
    utilization: float,
) -> MemoryProfile:
    """Run `run()` (the profile step) and measure this rank's budget around it; `baseline` is
    the snapshot taken before the weights loaded."""
    gc.collect()
    platform.empty_cache()
    platform.synchronize()
    weights = platform.memory_allocated()
    platform.reset_peak_memory_stats()
    run()
    platform.synchronize()
    peak = platform.max_memory_allocated()
    # Taken while the profile's cached blocks are still reserved by torch, so that they count
    # as torch memory (already in the peak), not as non-torch memory.
    free, total = platform.mem_get_info()
    after = MemorySnapshot(free=free, total=total, torch_reserved=platform.memory_reserved())
    gc.collect()
    platform.empty_cache()  # hand the activations' cached blocks back for the KV cache
    in_use_at_start = baseline.non_torch
    return MemoryProfile(
        total=total,
        utilization=utilization,
        weights=weights,
        activation_peak=max(0, peak - weights),
        non_torch=max(0, after.non_torch - in_use_at_start),
        in_use_at_start=in_use_at_start,
    )


def profile_chunks(config: EngineConfig, max_model_len: int, block_size: int) -> list[SeqChunk]:
    """The largest step the scheduler can issue, as fresh prefills: its token budget split into
    sequences of `max_model_len` tokens (the last one shorter), at most `max_num_seqs` of them.

    Long sequences are the attention's worst case (the portable backend's scores grow with the
    square of the length). Every block id is 0: the profile runs on a one-block scratch cache,
    so the kernels read and write valid memory whose contents do not matter.
    """
    limits = SchedulerConfig.from_engine_config(config, max_model_len)
    num_tokens = min(limits.max_num_batched_tokens, limits.max_num_seqs * max_model_len)
    chunks: list[SeqChunk] = []
    while num_tokens > 0:
        n = min(num_tokens, max_model_len)
        chunks.append(SeqChunk([0] * n, 0, [0] * math.ceil(n / block_size)))
        num_tokens -= n
    return chunks


def profile_sampling_requests(num_rows: int) -> list[Request]:
    """`num_rows` requests whose sampling takes the sampler's largest working set."""
    return [Request(f"memory-profile-{i}", [0], _PROFILE_SAMPLING) for i in range(num_rows)]


def min_kv_blocks(max_model_len: int, block_size: int) -> int:
    """Fewest blocks a profiled budget may give: one `max_model_len` sequence (and 2 at least)."""
    return max(2, math.ceil(max_model_len / block_size))


def check_kv_blocks(
    profile: MemoryProfile,
    num_blocks: int,
    bytes_per_block: int,
    max_model_len: int | None,
    block_size: int,
) -> None:
    """Raise ValueError, with the budget's numbers and what to change, when `num_blocks` (the
    smallest count over the ranks) cannot hold one `max_model_len` sequence (None: a length
    that will be fitted to the cache, so only the engine's minimum of 2 blocks is needed)."""
    needed = min_kv_blocks(max_model_len or 0, block_size)
    if num_blocks >= needed:
        return
    own = max(0, profile.kv_cache_memory // bytes_per_block)
    where = "" if own == num_blocks else f" (another rank's; this rank's budget holds {own})"
    what = f"one {max_model_len}-token sequence" if max_model_len else "the engine"
    raise ValueError(
        f"not enough device memory for the KV cache: the budget holds {num_blocks} blocks of "
        f"{bytes_per_block / _MiB:.2f} MiB{where}, and {what} needs "
        f"{needed}. This rank's budget: {profile.breakdown()}, leaving "
        f"{_gib(profile.kv_cache_memory)}. Raise --gpu-memory-utilization, lower "
        "--max-num-batched-tokens or --max-model-len, or set --kv-cache-memory."
    )
