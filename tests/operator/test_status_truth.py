"""Issue 34: status that never lies. The real kopf runtime (KopfRunner) against KMock's API-server
emulator, with the Deployment controller's status scripted by the test:

- after a spec change, no status write ever carries Ready=True for the new generation before the
  Deployment reports the new template rolled out (every write the operator made is replayed);
- the Deployment's ReplicaFailure (quota FailedCreate) and a serving pod's FailedMount /
  FailedAttachVolume (Multi-Attach) Warning Event each make Degraded=True within 10 s, with the message;
- a child the API server keeps refusing (a full Service IP range, a quota's 403) makes exactly its
  InferenceService Degraded ``ChildCreateFailed`` with the server's message while the retry goes on;
- nothing is kept per object once the objects are deleted (the object locks, kopf's per-object
  memories, the autoscaler's state).
"""
from __future__ import annotations

import asyncio
import copy
import gc
from pathlib import Path

import pytest
import yaml
from kmock._internal.dicts import patch_dict

from kmock_support import OPERATOR_TOKEN, running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import handlers, render

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
QUOTA = ('pods "smollm2-7d9f8c-x2k4q" is forbidden: exceeded quota: gpu-quota, requested: '
         'requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8')


def _sample(name: str = "smollm2", replicas: int = 1) -> dict:
    obj = yaml.safe_load((SAMPLES / "smollm2-135m-cpu.yaml").read_text())
    obj["metadata"].update(name=name, namespace="default")
    obj["spec"]["replicas"] = replicas
    return obj


def _cond(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def _condition(api, name: str, type_: str, timeout: float = 10.0, **fields) -> dict:
    async def met():
        o = await api.get(AV, PL, "default", name)
        c = _cond(o, type_)
        return o if all(c.get(k) == v for k, v in fields.items()) else None
    met.__name__ = f"{name}: {type_} {fields}"
    return await wait_for(met, timeout=timeout)


async def _deployment_reports(api, name: str, **status) -> None:
    """Play the Deployment controller: write the Deployment's status (observedGeneration given as
    ``observed=True`` means its current generation)."""
    dep = await api.get("apps/v1", "deployments", "default", name)
    if status.pop("observed", False):
        status["observedGeneration"] = dep["metadata"]["generation"]
    await api.patch("apps/v1", "deployments", "default", name, {"status": status}, subresource="status")


def _rolled_out(n: int) -> dict:
    return dict(observed=True, replicas=n, updatedReplicas=n, readyReplicas=n, availableReplicas=n)


def _operator_status_writes(writes: list[dict], name: str) -> list[dict]:
    return [w for w in writes if w["resource"] == PL and w["subresource"] == "status" and w["name"] == name
            and w["auth"] == f"Bearer {OPERATOR_TOKEN}"]


async def test_no_ready_for_a_new_generation_before_the_deployment_rolled_it_out(api, emulator):
    """Must-show 1 of issue 34: every status write after a spec change is replayed, and none may carry
    Ready=True for the new generation before the scripted Deployment reports it rolled out. The API
    server answers pod lists 0.3 s late (a loaded server). What this pins is the rollout check
    (``status.rollout``: the Deployment's observedGeneration and updatedReplicas); removing it fails
    here. The fresh read of the InferenceService under the object lock (``reconcile``) is not reached:
    kopf hands one object's events over one at a time, so the only pass that starts during the
    template-writing one is the echo of its own Deployment patch, which is skipped as no news; that
    read is pinned by test_coalesce.py::test_a_queued_pass_reads_the_object_once_it_holds_the_lock."""
    emulator.inject_delay("GET", "pods", 0.3)
    async with running_operator():
        await api.create(AV, PL, "default", _sample(replicas=2))
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"))
        await _deployment_reports(api, "smollm2", **_rolled_out(2))
        await _condition(api, "smollm2", "Ready", status="True", observedGeneration=1)
        start = await api.get(AV, PL, "default", "smollm2")
        before = len(emulator.writes)

        await api.patch(AV, PL, "default", "smollm2", {"spec": {"engine": {"maxModelLen": 1024}}})

        async def template_patched():
            d = await api.get("apps/v1", "deployments", "default", "smollm2")
            return d if "1024" in d["spec"]["template"]["spec"]["containers"][0]["args"] else None
        await wait_for(template_patched)
        # The Deployment controller rolls the new template out (maxSurge 0, maxUnavailable 1); the
        # operator catches up with each step before the next.
        steps = [dict(replicas=2, updatedReplicas=2, readyReplicas=2, availableReplicas=2),  # not observed yet
                 dict(observed=True, replicas=1, updatedReplicas=0, readyReplicas=1, availableReplicas=1),
                 dict(observed=True, replicas=2, updatedReplicas=1, readyReplicas=1, availableReplicas=1),
                 dict(observed=True, replicas=2, updatedReplicas=1, readyReplicas=2, availableReplicas=2),
                 dict(observed=True, replicas=1, updatedReplicas=1, readyReplicas=1, availableReplicas=1),
                 dict(observed=True, replicas=2, updatedReplicas=2, readyReplicas=1, availableReplicas=1)]
        for step in steps:
            await _deployment_reports(api, "smollm2", **step)

            async def caught_up(step=step):
                s = (await api.get(AV, PL, "default", "smollm2")).get("status") or {}
                return s.get("observedGeneration") == 2 and all(
                    s.get(k) == step[k] for k in ("replicas", "updatedReplicas", "readyReplicas"))
            await wait_for(caught_up)
        rolled_out_at = len(emulator.writes)
        await _deployment_reports(api, "smollm2", **_rolled_out(2))
        live = await _condition(api, "smollm2", "Ready", status="True", observedGeneration=2)

    # Replay every status write the operator made after the spec change, in order.
    status = copy.deepcopy(start["status"])
    early = []
    for w in _operator_status_writes(emulator.writes[before:rolled_out_at], "smollm2"):
        status = patch_dict(status, w["data"]["status"])
        ready = _cond({"status": status}, "Ready")
        if ready.get("status") == "True" and 2 in (ready.get("observedGeneration"), status.get("observedGeneration")):
            early.append(ready)
    assert early == [], f"Ready=True for generation 2 before the rollout finished: {early}"
    assert _operator_status_writes(emulator.writes[before:rolled_out_at], "smollm2"), "no write to check"
    assert _cond(live, "Ready")["reason"] == "Available" and live["status"]["observedGeneration"] == 2


async def test_quota_failed_create_is_degraded_within_seconds_and_clears(api, emulator):
    """Must-show 1 of issue 34: a ReplicaSet that cannot create its pods (a per-namespace GPU quota)
    shows as Degraded FailedCreate with the API server's message, not as "RollingOut 0 of 2" until
    the progress deadline."""
    async with running_operator():
        await api.create(AV, PL, "default", _sample(replicas=2))
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"))
        await _deployment_reports(api, "smollm2", observed=True, replicas=0, conditions=[
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetCreated"},
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": QUOTA}])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        live = await _condition(api, "smollm2", "Degraded", status="True", reason="FailedCreate")
        assert loop.time() - t0 < 10
        assert _cond(live, "Degraded")["message"] == QUOTA
        assert _cond(live, "Ready")["status"] == "False"
        # the quota is raised: the pods get created, the condition goes away
        await _deployment_reports(api, "smollm2", **_rolled_out(2), conditions=[
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}])
        live = await _condition(api, "smollm2", "Degraded", status="False")
        assert _cond(live, "Ready")["status"] == "True"


def _pending_pod(name: str, owner: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": render.common_labels(owner)},
            "spec": {"containers": [{"name": render.SERVER_CONTAINER, "image": "kvfleet-server:cpu"}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [{"name": render.SERVER_CONTAINER, "ready": False, "restartCount": 0,
                                              "image": "kvfleet-server:cpu", "imageID": "",
                                              "state": {"waiting": {"reason": "ContainerCreating"}}}]}}


VOLUME_EVENTS = {
    "FailedMount": ("kubelet", 'MountVolume.SetUp failed for volume "model-cache" : '
                               'persistentvolumeclaim "llama-weights" not found'),
    "FailedAttachVolume": ("attachdetach-controller",
                           'Multi-Attach error for volume "pvc-1f2e3d" Volume is already used by pod(s) '
                           'smollm2-6c5b4a-abcde'),
}


@pytest.mark.parametrize("reason", VOLUME_EVENTS)
async def test_volume_warning_of_a_serving_pod_is_degraded_within_seconds(api, emulator, reason):
    """Must-show 1 of issue 34: the pod only waits in ContainerCreating; the kubelet's (FailedMount) or
    the attach/detach controller's (FailedAttachVolume, Multi-Attach) Warning Event says why."""
    component, message = VOLUME_EVENTS[reason]
    async with running_operator():
        await api.create(AV, PL, "default", _sample())
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"))
        await _deployment_reports(api, "smollm2", observed=True, replicas=1, updatedReplicas=1)
        await _condition(api, "smollm2", "Ready", reason="WaitingForPods")
        await api.create("v1", "pods", "default", _pending_pod("smollm2-7d9f8c-x2k4q", "smollm2"))
        # someone else's pod with the same trouble changes nothing
        await api.create("v1", "pods", "default", {**_pending_pod("other-1", "other"),
                                                   "metadata": {"name": "other-1", "namespace": "default"}})
        for pod in ("other-1", "smollm2-7d9f8c-x2k4q"):
            await api.create("v1", "events", "default", {
                "apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": message,
                "metadata": {"name": f"{pod}.17a2b3c4", "namespace": "default"}, "count": 3,
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": "default"},
                "source": {"component": component}})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        live = await _condition(api, "smollm2", "Degraded", status="True", reason=reason)
        assert loop.time() - t0 < 10
        assert _cond(live, "Degraded")["message"] == f"pod smollm2-7d9f8c-x2k4q: {message}"
        # the volume attaches, the pod starts: its own event clears the condition
        await api.patch("v1", "pods", "default", "smollm2-7d9f8c-x2k4q", {"status": {
            "phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                               {"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": render.SERVER_CONTAINER, "ready": True, "started": True,
                                   "restartCount": 0, "image": "kvfleet-server:cpu", "imageID": "x",
                                   "state": {"running": {"startedAt": "2026-12-01T00:00:00Z"}}}]}},
            subresource="status")
        await _condition(api, "smollm2", "Degraded", status="False")
    assert await api.get(AV, PL, "default", "other") is None


async def test_a_child_the_api_server_keeps_refusing_degrades_exactly_its_owner(api, emulator):
    """Issue 34 (visible child failures): Services refused for two of four objects — a full Service IP
    range (500) and a quota (403). Exactly those two show Degraded ChildCreateFailed with the server's
    message, the others are Ready; their Deployments are still applied, and the retry goes on: once
    the API server accepts the Service, the condition clears."""
    full = "Internal error occurred: failed to allocate a serviceIP: range is full"
    quota = 'services "svc-c" is forbidden: exceeded quota: services, requested: services=1, used: services=10'
    emulator.inject_fault("POST", "services", times=1000, status=500, names={"svc-b"}, message=full)
    emulator.inject_fault("POST", "services", times=1000, status=403, names={"svc-c"}, message=quota)
    names = ["svc-a", "svc-b", "svc-c", "svc-d"]
    async with running_operator():
        for name in names:
            await api.create(AV, PL, "default", _sample(name))
        for name in names:
            await wait_for(lambda name=name: api.get("apps/v1", "deployments", "default", name))
            await _deployment_reports(api, name, **_rolled_out(1))
        b = await _condition(api, "svc-b", "Degraded", status="True", reason="ChildCreateFailed")
        c = await _condition(api, "svc-c", "Degraded", status="True", reason="ChildCreateFailed")
        for name in ("svc-a", "svc-d"):
            ok = await _condition(api, name, "Ready", status="True")
            assert _cond(ok, "Degraded")["status"] == "False"
            assert await api.get("v1", "services", "default", name)
        assert _cond(b, "Degraded")["message"] == (
            f"create of Service default/svc-b refused by the API server (500 InjectedFault): {full}; "
            f"retrying with backoff")
        assert f"(403 InjectedFault): {quota}" in _cond(c, "Degraded")["message"]
        assert await api.get("v1", "services", "default", "svc-b") is None
        # the IP range is widened: the retry (with backoff) creates the Service and clears the condition
        emulator.faults.clear()
        await _condition(api, "svc-b", "Degraded", status="False", timeout=15)
        assert await api.get("v1", "services", "default", "svc-b")


def _live_instances(type_name: str) -> list:
    gc.collect()  # what earlier tests left unreachable is not alive
    return [o for o in gc.get_objects() if type(o).__name__ == type_name]


async def test_nothing_is_kept_per_object_after_deletion(api, emulator):
    """Issue 34 (bounded memory): N objects (half autoscaled: a daemon each) are reconciled, then
    deleted with their children (the garbage collector's part): the object locks, kopf's per-object
    memories and the autoscalers' states are all gone."""
    from kopf._core.reactor.inventory import ResourceMemories

    n = 6
    earlier = {id(m) for m in _live_instances("ResourceMemories")}  # of operators run by earlier tests
    async with running_operator("kvfleet_operator.handlers", "kvfleet_operator.autoscaler"):
        for i in range(n):
            obj = _sample(f"obj-{i}")
            if i % 2:
                obj["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 2}
            await api.create(AV, PL, "default", obj)
        for i in range(n):
            await wait_for(lambda i=i: api.get("apps/v1", "deployments", "default", f"obj-{i}"))
            await _deployment_reports(api, f"obj-{i}", **_rolled_out(1))
        for i in range(n):
            await _condition(api, f"obj-{i}", "Ready", status="True")
        await wait_for(lambda: len(_live_instances("AutoscalerState")) == n // 2, interval=0.5)
        memories = [m for m in _live_instances("ResourceMemories")
                    if isinstance(m, ResourceMemories) and id(m) not in earlier]
        assert len(memories) == 1
        assert sum(len(m._items) for m in memories) >= n  # kopf remembers each object while it exists

        for i in range(n):
            await api.delete(AV, PL, "default", f"obj-{i}")
        for i in range(n):
            for av, plural in (("apps/v1", "deployments"), ("v1", "services"), ("policy/v1", "poddisruptionbudgets")):
                await api.delete(av, plural, "default", f"obj-{i}")

        async def all_gone():
            return not [o for o in await api.list(AV, PL, "default")]
        await wait_for(all_gone)
        await wait_for(lambda: not handlers._locks)
        await wait_for(lambda: not _live_instances("AutoscalerState"), interval=0.5)
        await wait_for(lambda: sum(len(m._items) for m in memories) == 0, interval=0.5)
