"""Giving the memory of deleted InferenceServices back to the operating system.

Python frees an object's memory into its own allocator (pymalloc arenas) and glibc's heap; neither is
returned to the kernel while other live objects share its pages, so an operator that watched a burst
of 1,000 objects keeps its peak RSS after they are gone (73 -> 301 MB measured on a real API server,
never returned). After deletions, ``trim_soon`` runs one full garbage collection and glibc's
``malloc_trim(0)``, which releases free heap pages (``madvise``) — debounced, so a burst of deletions
costs one trim. Elsewhere than glibc (musl, macOS) only the collection runs.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc

TRIM_DELAY_S = 5.0  # after the last deletion of a burst

_libc = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # no glibc
    _libc = None

_pending: asyncio.TimerHandle | None = None


def trim() -> bool:
    """Collect garbage and return free heap pages to the kernel; True if glibc released any."""
    gc.collect()
    return bool(_libc.malloc_trim(0)) if _libc is not None else False


def trim_soon(delay_s: float = TRIM_DELAY_S) -> None:
    """Schedule ``trim`` ``delay_s`` seconds after the latest call (on the running event loop)."""
    global _pending
    if _pending is not None:
        _pending.cancel()
    loop = asyncio.get_running_loop()

    def run() -> None:
        global _pending
        _pending = None
        trim()

    _pending = loop.call_later(delay_s, run)
