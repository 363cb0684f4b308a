"""The model server's readiness, probed for real and cached for a few seconds, so a storm of
probes (kubelet, load balancers, users) costs the model server one request per period."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

Probe = Callable[[], Awaitable[dict[str, Any]]]


class CachedHealth:
    def __init__(self, probe: Probe, ttl_seconds: float) -> None:
        self._probe = probe
        self._ttl = ttl_seconds
        self._state: dict[str, Any] | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    def _fresh(self) -> dict[str, Any] | None:
        if self._state is not None and time.monotonic() - self._at < self._ttl:
            return self._state
        return None

    async def get(self) -> dict[str, Any]:
        """The last probe's result if younger than the TTL, else a new probe's (concurrent
        callers share one probe)."""
        if (state := self._fresh()) is not None:
            return state
        async with self._lock:
            if (state := self._fresh()) is not None:
                return state
            self._state = await self._probe()
            self._at = time.monotonic()
            return self._state
