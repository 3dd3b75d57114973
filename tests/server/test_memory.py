"""kvfleet_server.memory: freed heap pages go back to the OS (the server calls it once the engine is built)."""

from __future__ import annotations

import sys

import pytest

from kvfleet_server.memory import release_freed_heap, resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc")


def test_release_freed_heap_returns_freed_chunks_to_the_os():
    chunks = [bytes(1000) for _ in range(150_000)]  # ~150 MB of malloc'd (not pymalloc) blocks
    keep = chunks[::100]  # a few survivors pin the heap: free() alone cannot shrink it
    del chunks
    held = resident_bytes()
    assert release_freed_heap()
    after = resident_bytes()
    assert held - after > 100e6, (held, after)
    assert len(keep) == 1500
