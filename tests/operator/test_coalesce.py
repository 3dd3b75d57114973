"""Child events of one InferenceService coalesce: while a pass runs, a burst of events (a rollout's
Deployment, ReplicaSet and pod updates) queues one more pass, not one each, and that pass reads after
the last event. Passes with a condition (``only_if``), kopf's own handler passes and passes of other
objects are never dropped; a waiter that is cancelled leaves nothing counted."""
from __future__ import annotations

import asyncio

import pytest

from kvfleet_operator import handlers, kube


class FakeClient:
    def __init__(self) -> None:
        self.reads = 0
        self.generation = 1  # the InferenceService's metadata.generation as the API server has it now
        self.handed: list[int] = []  # the generation of the object each pass was handed

    async def get(self, api_version, plural, namespace, name):
        self.reads += 1
        return {"metadata": {"name": name, "namespace": namespace, "generation": self.generation}}


@pytest.fixture
def passes(monkeypatch):
    client = FakeClient()
    runs: list[tuple[str, int]] = []  # (object, the client's read count when the pass started)
    gate = asyncio.Event()

    async def fake_reconcile(client_, obj, namespace, name, logger, retry):
        runs.append((name, client.reads))
        client.handed.append(obj["metadata"]["generation"])
        await gate.wait()
        return {}

    monkeypatch.setattr(kube, "get_client", lambda: client)
    monkeypatch.setattr(handlers, "_reconcile", fake_reconcile)
    return runs, gate


async def test_a_burst_of_child_events_costs_one_queued_pass(passes):
    runs, gate = passes
    log = handlers.logging.getLogger("test")
    first = asyncio.create_task(handlers.reconcile("ns", "a", log))  # kopf's pass: holds the lock
    await asyncio.sleep(0)
    burst = [asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True)) for _ in range(20)]
    other = asyncio.create_task(handlers.reconcile("ns", "b", log, coalesce=True))  # another object
    conditional = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True, only_if=lambda o: True))
    kopf_pass = asyncio.create_task(handlers.reconcile("ns", "a", log))
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(first, *burst, other, conditional, kopf_pass)
    names = [n for n, _ in runs]
    # the first pass, one for the whole burst, the conditional one and kopf's: 4 of "a"; 1 of "b"
    assert names.count("a") == 4 and names.count("b") == 1
    assert not handlers._locks


async def test_an_event_dropped_for_a_queued_pass_runs_that_pass_whatever_its_news(passes):
    """A Deployment event's queued pass would skip itself (a completed pass read its version); a failing
    pod's event, dropped for that queued pass, makes it run: the pod failure reaches the status."""
    runs, gate = passes
    log = handlers.logging.getLogger("test")
    first = asyncio.create_task(handlers.reconcile("ns", "a", log))
    await asyncio.sleep(0)
    stale = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True, news=lambda: False))
    await asyncio.sleep(0)
    pod = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True))  # dropped: stale covers it
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(first, stale, pod)
    assert [n for n, _ in runs] == ["a", "a"]
    alone = await handlers.reconcile("ns", "a", log, coalesce=True, news=lambda: False)  # nothing dropped
    assert alone == {} and len(runs) == 2 and not handlers._locks


async def test_echoes_dropped_for_a_queued_pass_do_not_make_it_run(passes):
    """The watch's echoes of a pass's own writes, dropped for a queued pass, are no news either."""
    runs, gate = passes
    log = handlers.logging.getLogger("test")
    first = asyncio.create_task(handlers.reconcile("ns", "a", log))
    await asyncio.sleep(0)
    echoes = [asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True, news=lambda: False))
              for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(first, *echoes)
    assert len(runs) == 1 and not handlers._locks


async def test_a_cancelled_waiter_leaves_no_queued_pass(passes):
    runs, gate = passes
    log = handlers.logging.getLogger("test")
    first = asyncio.create_task(handlers.reconcile("ns", "a", log))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    later = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True))  # must not be dropped
    await asyncio.sleep(0.01)
    gate.set()
    await first
    await later
    assert [n for n, _ in runs] == ["a", "a"]
    assert not handlers._locks


async def test_a_queued_pass_reads_the_object_once_it_holds_the_lock(passes):
    """Issue 34's stale status: a child event's pass that waits for the lock reads the InferenceService
    after the pass before it finished (its status write, a spec change meanwhile), never before it
    queued: its status is computed from the object as it is when it runs."""
    runs, gate = passes
    client = kube.get_client()
    log = handlers.logging.getLogger("test")
    first = asyncio.create_task(handlers.reconcile("ns", "a", log))  # holds the lock
    await asyncio.sleep(0.01)
    child = asyncio.create_task(handlers.reconcile("ns", "a", log, coalesce=True))  # a Deployment event
    await asyncio.sleep(0.01)
    client.generation = 2  # the user changes the spec while the child event's pass waits
    gate.set()
    await asyncio.gather(first, child)
    assert client.handed == [1, 2] and not handlers._locks


async def test_a_pod_event_raises_the_pod_lists_floor_before_its_pass(monkeypatch):
    """The pass a pod event triggers, or the queued pass that covers it, lists pods at least as new as the
    event (``kube.seen``), so a lagging API server's watch cache cannot hide it."""
    monkeypatch.setattr(kube, "_seen", {})
    floors: list[int] = []

    async def child_event(namespace, owner, logger, only_if=None, news=None):
        floors.append(kube.seen("pods"))

    monkeypatch.setattr(handlers, "_child_event", child_event)
    body = {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "321",
                         "labels": {handlers.render.OWNER_LABEL: "a"}}, "status": {}}
    await handlers.pod_event(body=body, logger=handlers.logging.getLogger("test"))
    assert floors == [321]
