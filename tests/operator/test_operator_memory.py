"""memory.trim_soon: one trim after a burst of deletions (debounced), and the trim itself runs."""
from __future__ import annotations

import asyncio

from kvfleet_operator import memory


async def test_a_burst_of_deletions_costs_one_trim(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "trim", lambda: calls.append(1) or True)
    for _ in range(50):
        memory.trim_soon(0.05)
    await asyncio.sleep(0.2)
    assert calls == [1]
    memory.trim_soon(0.05)
    await asyncio.sleep(0.2)
    assert calls == [1, 1]


def test_trim_runs_on_this_platform():
    assert memory.trim() in (True, False)
