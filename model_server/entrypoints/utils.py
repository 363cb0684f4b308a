"""Asyncio helpers for the HTTP layer: merging request streams, noticing a client that left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def merge_async_iterators(
    *iterators: AsyncIterator[T],
) -> AsyncGenerator[tuple[int, T], None]:
    """Yield `(index, item)` from several async iterators as items arrive.

    However the consumer stops (exhausted, closed, cancelled), every iterator is closed before
    this returns, so engine requests behind them are aborted at once.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _aclose(it)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(RuntimeError, StopAsyncIteration):
            await aclose()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """`first`, then the items of `rest` (closed however this generator ends)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await _aclose(rest)


async def listen_for_disconnect(request: Request) -> None:
    """Return once the client has gone. Call only after the body was read: it consumes
    `receive()` messages."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def cancel_on_disconnect(awaitable: Awaitable[T], request: Request) -> T:
    """Await `awaitable`, but cancel it (aborting its engine requests) the moment the client
    disconnects, then raise ClientDisconnected. Used for non-streaming responses and for the
    wait before a stream's first byte; Starlette watches streams themselves."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we ourselves were cancelled (server shutdown): take `work` along
        work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        raise
    if work in done:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected()
