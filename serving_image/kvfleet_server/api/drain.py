"""Graceful drain: after SIGTERM, refuse new work, finish in-flight requests, then let the process exit.

Sequence (what makes a rolling update lose no request): ``start()`` turns /health to 503 and new
generation requests to 503 at once; ``wait_idle(timeout)`` waits until every in-flight HTTP request on
the generation endpoints (streams included) has sent its last byte; requests still running after
``--shutdown-timeout`` seconds are aborted (finish_reason "abort") by the caller.
"""

from __future__ import annotations

import asyncio

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Drain:
    """Counts in-flight generation requests and tracks the draining flag (asyncio loop only)."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.inflight -= 1
        if self.inflight <= 0:
            self.inflight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no generation request is in flight within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class InflightMiddleware:
    """Pure ASGI middleware: counts a generation request as in flight until its response is fully sent."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.exit()
