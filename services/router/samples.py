"""``n`` samples of one prompt served as one request, for the gRPC and the HTTP front alike.

    samples ──▶ first events: sample 0 alone (its prefill publishes the prompt's blocks, which the
                others then reuse), then the rest together; any failure here fails the request
            ──▶ merged: (sample index, event) as they arrive, each sample's first event first,
                until every sample has sent its Completion

Taking every first event before answering lets a front report a request that fails before its
first token (capacity, no worker, bad prompt) as an error status, not mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.router.dispatcher import Completion, TextDelta


async def first_events(streams: list[AsyncIterator]) -> list:
    """The first event of every stream (see the module docstring). On any failure every stream
    is closed and the error raised."""
    try:
        firsts = [await anext(streams[0])]
        if len(streams) > 1:
            rest = await asyncio.gather(*(anext(s) for s in streams[1:]), return_exceptions=True)
            for r in rest:
                if isinstance(r, BaseException):
                    raise r
            firsts += rest
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return firsts


async def merged(firsts: list, streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, TextDelta | Completion]]:
    """(sample index, event) of all samples as they arrive, each sample's first event first.
    A sample's error is raised (ending the others). Closing it (client gone) cancels every
    sample still running."""
    if len(streams) == 1:  # the common case: no task and no queue hop per event
        try:
            yield 0, firsts[0]
            if not isinstance(firsts[0], Completion):
                async for event in streams[0]:
                    yield 0, event
        finally:
            await streams[0].aclose()
        return
    # Bounded: a client that reads slowly stops the samples' readers, and with them their workers
    # (stream windows: services.common.channels.stream_window_options), as it does one sample.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int) -> None:
        try:
            async for event in streams[i]:
                await queue.put((i, event))
        except Exception as exc:  # typed errors reach the client
            await queue.put((i, exc))

    for i, first in enumerate(firsts):
        queue.put_nowait((i, first))
    tasks = [asyncio.ensure_future(pump(i)) for i, first in enumerate(firsts) if not isinstance(first, Completion)]
    try:
        remaining = len(firsts)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            remaining -= isinstance(item, Completion)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
