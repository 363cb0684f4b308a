"""Helpers for the microservice's unit tests (no server, no model: in-process, milliseconds)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
    """Run `coro` to completion; a hang fails the test instead of the run."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's LLM_* variables must not leak into settings under test."""
    import os

    for name in list(os.environ):
        if name.startswith("LLM_"):
            monkeypatch.delenv(name)
