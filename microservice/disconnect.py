"""Noticing a client that left while a service waits on the model server (the LLM, embedding
and reranking services share it): the upstream call is cancelled at once, so the model server
aborts its work, and the service logs nginx's 499."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request"


class ClientGone(Exception):
    """The client disconnected while we waited for the model server."""


async def until_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`, cancelling it (and raising ClientGone) if the client disconnects
    first. Call only after the body was read: it consumes `receive()` messages."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
