"""Giving freed heap memory back to the OS.

glibc keeps memory freed by Python (a burst of large request bodies, their parsed JSON, tokenizer
outputs, chat templates) in its arenas; without a trim the process's RSS stays at its high-water
mark after the burst, and requests refused by the HTTP layer (over a limit) free as much as the
served ones. `malloc_trim(0)` walks every arena and returns their free pages: about 13 ms after
100 MB were freed, ~20 us when there is nothing to return (measured, Zen 5), so the engine thread
calls it on a clock: every `idle_interval_s` while it has nothing to run (it wakes for that), and
every `busy_interval_s` between steps under sustained load (a trim holds the arenas' locks, so
other threads' allocations wait for it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any


@cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (musl, macOS: their allocators return memory themselves)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the allocator's free pages to the OS; False where there is no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@dataclass(slots=True)
class HeapTrimmer:
    """When the engine thread trims the heap (engine thread only)."""

    idle_interval_s: float = 5.0
    busy_interval_s: float = 60.0
    _last_trim: float = field(default_factory=time.monotonic)

    def _interval(self, idle: bool) -> float:
        return self.idle_interval_s if idle else self.busy_interval_s

    def seconds_until_due(self, idle: bool, now: float | None = None) -> float:
        """How long until the next trim is due (0: now)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self._last_trim + self._interval(idle) - now)

    def maybe_trim(self, idle: bool, now: float | None = None) -> bool:
        """Trim if one is due; returns whether it trimmed."""
        now = time.monotonic() if now is None else now
        if self.seconds_until_due(idle, now) > 0:
            return False
        self._last_trim = now
        return trim_heap()
