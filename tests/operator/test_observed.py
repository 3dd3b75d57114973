"""What the operator knows of its children between passes (``observed``): a new InferenceService's
children are created without first reading them (no GET answered 404), the watch's echo of the
operator's own writes starts no pass, a Deployment status the controller writes still does, a child
that exists but was never seen (somebody else's) is found by the create's 409 and reported, and
nothing is kept once the objects are gone. The pure bookkeeping first, then the real kopf runtime
against KMock."""
from __future__ import annotations

import asyncio
import copy

import kopf
from prometheus_client import REGISTRY

from kmock_support import running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import diffbase, handlers, observed
from test_status_truth import _cond, _condition, _deployment_reports, _rolled_out, _sample

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL


def _obj(rv: int) -> dict:
    return {"metadata": {"resourceVersion": str(rv)}}


def test_an_event_is_news_until_a_completed_pass_has_read_its_version():
    observed.forget("ns", "a", handlers.CHILD_PLURALS)
    assert not observed.known("ns", "a", "deployments")
    assert observed.watched("ns", "a", "deployments", "10", deleted=False)  # never read: news
    assert observed.known("ns", "a", "deployments") and observed.pending("ns", "a", handlers.CHILD_PLURALS)
    observed.seen("ns", "a", "deployments", _obj(12))  # a pass read it, but has not completed
    assert observed.watched("ns", "a", "deployments", "12", deleted=False)
    observed.accounted("ns", "a", {"deployments": _obj(12), "services": None, "poddisruptionbudgets": None})
    assert not observed.pending("ns", "a", handlers.CHILD_PLURALS)
    assert not observed.watched("ns", "a", "deployments", "12", deleted=False)  # the echo of what it read
    assert not observed.watched("ns", "a", "deployments", "11", deleted=False)  # an older one, late
    assert observed.watched("ns", "a", "deployments", "13", deleted=False)  # the controller wrote since
    assert observed.watched("ns", "a", "deployments", "not-a-number", deleted=False)  # opaque: always news
    observed.accounted("ns", "a", {"deployments": _obj(13)})
    assert observed.watched("ns", "a", "deployments", "13", deleted=True)  # a deletion always is
    assert observed.pending("ns", "a", handlers.CHILD_PLURALS)
    observed.accounted("ns", "a", {"deployments": None})  # the pass found it gone
    assert not observed.known("ns", "a", "deployments") and not observed.pending("ns", "a", handlers.CHILD_PLURALS)
    observed.seen("ns", "a", "services", {})  # a create answered 409: exists, version unknown
    assert observed.known("ns", "a", "services")
    observed.forget("ns", "a", handlers.CHILD_PLURALS)
    assert not observed.known("ns", "a", "services")


def _count(verb: str, resource: str, code: str | None = None) -> float:
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name != "kvfleet_operator_api_requests":
            continue
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels["verb"] == verb and s.labels["resource"] == resource \
                    and (code is None or s.labels["code"] == code):
                total += s.value
    return total


def _reconciles(result: str) -> float:
    return REGISTRY.get_sample_value("kvfleet_operator_reconciles_total", {"result": result}) or 0.0


async def test_a_new_object_costs_no_404_reads_and_its_own_echoes_no_pass(api, emulator):
    before = {k: _count("GET", k) for k in ("deployments", "services", "poddisruptionbudgets")}
    unchanged = _reconciles("unchanged")
    async with running_operator():
        await api.create(AV, PL, "default", _sample("fresh", replicas=1))
        await _condition(api, "fresh", "Ready", status="False")
        await asyncio.sleep(1.0)  # the watch delivers the echoes of the Deployment and Service creates
        reads = {k: _count("GET", k) - v for k, v in before.items()}  # (this test reads no child until here)
        assert await api.get("v1", "services", "default", "fresh") is not None
        # created without a read (no 404), the one-replica service wants no PDB and none was seen
        assert reads == {"deployments": 0, "services": 0, "poddisruptionbudgets": 0}, reads
        assert _reconciles("unchanged") > unchanged  # echoes of its own writes
        # what the Deployment controller writes is news: a pass reads it and the status follows
        await _deployment_reports(api, "fresh", **_rolled_out(1))
        await _condition(api, "fresh", "Ready", status="True")
        assert _count("GET", "deployments") - before["deployments"] >= 2  # the test's read, the pass's
        await api.delete(AV, PL, "default", "fresh")
        await wait_for(lambda: not any(observed.known("default", "fresh", p) for p in handlers.CHILD_PLURALS) or None)


async def test_a_child_nobody_saw_is_found_by_the_creates_conflict(api, emulator):
    # somebody else's Deployment of the same name: not labelled as ours, so the watch never shows it
    await api.create("apps/v1", "deployments", "default", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "taken", "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "template": {"metadata": {"labels": {"app": "x"}},
                 "spec": {"containers": [{"name": "x", "image": "x"}]}}}})
    conflicts = _count("POST", "deployments", "409")
    async with running_operator():
        await api.create(AV, PL, "default", _sample("taken"))
        obj = await _condition(api, "taken", "Degraded", status="True", reason="ChildConflict")
        assert "Deployment default/taken exists and is not controlled by" in _cond(obj, "Degraded")["message"]
        assert _count("POST", "deployments", "409") > conflicts  # created blind, refused, then read
        dep = await api.get("apps/v1", "deployments", "default", "taken")
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "x"  # untouched


def test_an_event_delivered_during_a_pass_stays_news_after_it():
    observed.forget("ns", "b", handlers.CHILD_PLURALS)
    observed.seen("ns", "b", "deployments", _obj(20))  # the pass reads version 20 ...
    assert observed.watched("ns", "b", "deployments", "21", deleted=False)  # ... the controller writes 21
    observed.accounted("ns", "b", {"deployments": _obj(20)})  # the pass completes from 20
    assert observed.pending("ns", "b", handlers.CHILD_PLURALS)  # the queued pass must still run
    observed.forget("ns", "b", handlers.CHILD_PLURALS)


async def test_the_creating_pass_lists_no_pods_and_a_healthy_pods_event_reads_nothing(api, emulator):
    """The pass that creates the Deployment lists no pods (none can be its pods yet). A healthy pod's
    event, while the status this process wrote names no pod failure, costs no request at all; a failing
    pod's event does start a pass, and once that status names the failure, the healthy pod's next event
    reads the InferenceService and clears it."""
    from test_pod_failures import CRASH, pod

    pod_lists, reads = _count("GET", "pods"), _count("GET", PL)
    async with running_operator():
        await api.create(AV, PL, "default", _sample("calm"))
        await _condition(api, "calm", "Ready", status="False")
        await asyncio.sleep(1.0)
        assert _count("GET", "pods") == pod_lists
        passes_read = _count("GET", PL) - reads
        unchanged = _reconciles("unchanged")
        await api.create("v1", "pods", "default", pod("calm-0", "calm"))  # healthy, Running
        await wait_for(lambda: _reconciles("unchanged") > unchanged or None)
        assert _count("GET", PL) - reads == passes_read and _count("GET", "pods") == pod_lists
        await api.patch("v1", "pods", "default", "calm-0", {"status": {"containerStatuses": CRASH}})
        await _condition(api, "calm", "Degraded", status="True", reason="CrashLoopBackOff")
        await api.patch("v1", "pods", "default", "calm-0", {"status": {"containerStatuses": [
            {**CRASH[0], "ready": True, "started": True, "state": {"running": {}}}]}})
        await _condition(api, "calm", "Degraded", status="False")
        await api.delete(AV, PL, "default", "calm")
        await wait_for(lambda: observed.pod_failure_reported("default", "calm") is None or None)  # nothing kept


async def test_a_status_somebody_else_wrote_and_a_deletion_drop_the_pod_failure_record():
    """The record of what this process wrote is dropped when the watch shows a status saying otherwise
    (a peer operator, a user), and on deletion only after the pass in flight is over."""
    degraded = {"status": {"conditions": [{"type": "Degraded", "status": "True", "reason": "Unschedulable"}]}}
    meta = {"metadata": {"name": "peer", "namespace": "ns"}}
    observed.reported("ns", "peer", False)
    await handlers.isvc_event(body={**meta, "status": {}}, event={"type": "MODIFIED"})  # says the same
    assert observed.pod_failure_reported("ns", "peer") is False
    await handlers.isvc_event(body={**meta, **degraded}, event={"type": "MODIFIED"})
    assert observed.pod_failure_reported("ns", "peer") is None
    async with handlers.object_lock("ns", "peer"):  # a pass in flight ...
        gone = asyncio.create_task(handlers.isvc_event(body=meta, event={"type": "DELETED"}))
        await asyncio.sleep(0.01)
        observed.reported("ns", "peer", False)  # ... completes after the DELETED event arrived
    await gone
    assert observed.pod_failure_reported("ns", "peer") is None and not handlers._locks


async def test_kopf_writes_nothing_to_the_object_and_still_tells_a_spec_change_from_an_echo(api, emulator):
    """kopf's last-handled state stays in memory (``diffbase``): creating an InferenceService writes only
    its status (no annotation PATCH, whose watch event would be one more event to process), a spec change
    is still reconciled, and nothing is kept once the object is deleted."""
    async with running_operator():
        await api.create(AV, PL, "default", _sample("quiet", replicas=1))
        await _condition(api, "quiet", "Ready", status="False")
        await asyncio.sleep(1.0)
        own = [(w["method"], w["subresource"]) for w in emulator.writes if w["resource"] == PL and w["name"] == "quiet"]
        assert own and all(sub == "status" for _, sub in own), own  # the test's create has no name in the path
        uid = (await api.get(AV, PL, "default", "quiet"))["metadata"]["uid"]
        assert uid in handlers.DIFFBASE._essences
        await api.patch(AV, PL, "default", "quiet", {"spec": {"engine": {"maxNumSeqs": 7}}})

        async def rolled():
            dep = await api.get("apps/v1", "deployments", "default", "quiet")
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            return args[args.index("--max-num-seqs") + 1] == "7"
        await wait_for(rolled)
        await wait_for(lambda: _observed_generation(api, "quiet", 2))
        await api.delete(AV, PL, "default", "quiet")
        await wait_for(lambda: uid not in handlers.DIFFBASE._essences or None)
        assert len(handlers.DIFFBASE) == 0


async def _observed_generation(api, name: str, generation: int) -> bool:
    return ((await api.get(AV, PL, "default", name)).get("status") or {}).get("observedGeneration") == generation


def test_the_essence_is_kopfs_own_without_copying_status_or_managed_fields():
    """``MemoryDiffBaseStorage.build`` gives the essence kopf's stock ``build`` gives (spec, labels,
    annotations less kopf's marked ones and kubectl's last-applied), from a body whose status and
    managedFields it never copies; a label or spec change still shows in it, a status change does not."""
    class Stock(kopf.DiffBaseStorage):
        def fetch(self, *, body):
            return None

        def store(self, *, body, patch, essence):
            pass

    body = {"apiVersion": AV, "kind": "InferenceService",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u1", "resourceVersion": "7", "generation": 2,
                         "labels": {"team": "x"},
                         "annotations": {"note": "keep", "kopf.serving.kvfleet.dev/kopf-managed": "yes",
                                         "kopf.serving.kvfleet.dev/reconcile": "{}",
                                         "kopf.serving.kvfleet.dev/last-handled-configuration": "{}",
                                         "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
            "spec": {"model": {"uri": "hf://a/b"}, "replicas": 2, "engine": {"args": ["--x"]}},
            "status": {"observedGeneration": 2, "conditions": [{"type": "Ready", "status": "False"}]}}
    mine, stock = diffbase.MemoryDiffBaseStorage(), Stock()
    essence = mine.build(body=kopf.Body(body))
    assert essence == stock.build(body=kopf.Body(body))
    assert essence == {"spec": body["spec"], "metadata": {"labels": {"team": "x"}, "annotations": {"note": "keep"}}}
    essence["spec"]["engine"]["args"].append("--y")  # a copy: the body is untouched
    assert body["spec"]["engine"]["args"] == ["--x"]
    changed = copy.deepcopy(body)
    changed["status"]["observedGeneration"] = 3
    changed["metadata"]["managedFields"].append({"manager": "kvfleet"})
    assert mine.build(body=kopf.Body(changed)) == stock.build(body=kopf.Body(body))
    changed["metadata"]["labels"]["team"] = "y"
    assert mine.build(body=kopf.Body(changed)) != stock.build(body=kopf.Body(body))
    extra = ["status.observedGeneration"]  # a handler filtering on a status field: kopf's own way
    assert mine.build(body=kopf.Body(body), extra_fields=extra) == stock.build(body=kopf.Body(body), extra_fields=extra)
