"""Async helpers shared by the generation routes: merging several engine streams, SSE framing,
and running a non-streaming handler that stops (and aborts its requests) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from ..outputs import RequestOutput
from .async_engine import RequestStream

_DONE = object()


def sse(obj) -> str:
    """One server-sent event carrying a JSON object (or the literal ``[DONE]``)."""
    if obj == "[DONE]":
        return "data: [DONE]\n\n"
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` from several engine streams as they arrive.

    Exceptions of any stream propagate; on exit (normal, error or cancellation) every stream is closed,
    which aborts unfinished engine requests.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, _DONE))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable, streams: list[RequestStream]):
    """Await ``work``; if the client disconnects first, cancel it and abort ``streams`` (freeing KV blocks)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    for s in streams:
        s.close()
    return Response(status_code=499)


class EngineStreamResponse(StreamingResponse):
    """SSE response that closes its engine streams however the response ends.

    The body generator's own ``finally`` does not run if the client is gone before the first chunk is
    pulled; closing here too guarantees the abort (``RequestStream.close`` is idempotent).
    """

    def __init__(self, content, streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()
