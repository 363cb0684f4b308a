"""The heap trimmer: glibc's malloc_trim gives freed arena memory back, on the engine's clock."""

from __future__ import annotations

import ctypes.util

import pytest

from model_server.engine.allocator import HeapTrimmer, trim_heap

GLIBC = ctypes.util.find_library("c") is not None and "libc.so" in ctypes.util.find_library("c")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_returns_freed_memory_that_free_alone_keeps() -> None:
    """A burst of malloc'd objects (2 KB strings: past Python's small-object allocator) freed
    but for one in a hundred: the survivors pin the arena, so RSS stays at the burst's level
    until a trim returns the free pages between them."""
    trim_heap()
    before = rss_mib()
    burst = [("x" * 2000) + str(i) for i in range(50_000)]  # ~100 MB
    kept = burst[::100]
    del burst
    held = rss_mib()
    assert held - before > 50, (before, held)  # freed, and still resident
    assert trim_heap()
    assert rss_mib() - before < (held - before) / 4, (before, held, rss_mib())
    assert len(kept) == 500


def test_trimmer_is_due_on_its_idle_and_busy_clocks() -> None:
    trimmer = HeapTrimmer(idle_interval_s=5.0, busy_interval_s=60.0)
    start = trimmer._last_trim
    assert trimmer.seconds_until_due(idle=True, now=start + 1) == pytest.approx(4.0)
    assert not trimmer.maybe_trim(idle=True, now=start + 1)
    assert not trimmer.maybe_trim(idle=False, now=start + 30)  # busy: a minute apart
    assert trimmer.maybe_trim(idle=True, now=start + 5) == GLIBC
    assert trimmer.seconds_until_due(idle=False, now=start + 5) == pytest.approx(60.0)
    assert trimmer.maybe_trim(idle=False, now=start + 65) == GLIBC
