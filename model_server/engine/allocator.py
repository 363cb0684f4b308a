"""Giving freed heap memory back to the OS when the engine goes idle.

glibc keeps memory freed by Python (a burst of large request bodies, tokenizer outputs, chat
templates) in its arenas; without a trim the process's RSS stays at its high-water mark after
the burst. `malloc_trim(0)` walks every arena and returns their free pages. It takes a few
milliseconds on a large heap, so the engine calls it only when it has nothing to run, at most
once per `min_interval_s`, and only after it has served requests since the last trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass, field
from functools import cache

logger = logging.getLogger(__name__)


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
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
class IdleHeapTrimmer:
    """Trims the heap when the engine goes idle after serving (engine thread only)."""

    min_interval_s: float = 5.0
    _last_trim: float = field(default=float("-inf"))
    _served_since_trim: bool = False

    def served(self) -> None:
        """The engine ran a step or took commands since the last trim."""
        self._served_since_trim = True

    def seconds_until_due(self, now: float | None = None) -> float | None:
        """How long until a trim is due (0: now); None when none is pending."""
        if not self._served_since_trim:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._last_trim + self.min_interval_s - now)

    def idle(self, now: float | None = None) -> bool:
        """The engine has nothing to run: trim if it served since the last trim and the last
        one is `min_interval_s` old. Returns whether it trimmed."""
        now = time.monotonic() if now is None else now
        if not self._served_since_trim or now - self._last_trim < self.min_interval_s:
            return False
        self._last_trim = now
        self._served_since_trim = False
        return trim_heap()
