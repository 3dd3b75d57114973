"""Must-show 5 of issue 17: status says why pods fail. The real kopf runtime (KopfRunner) against KMock,
with Pod objects as the kubelet reports them in each failure state: Degraded=True with the matching
reason and message within seconds (not after the 40-minute progress deadline), and back to
Degraded=False / Ready when the pods recover. Plus the pure classification (kvfleet_operator.pods)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kmock_support import running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import pods, render

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
IMAGE = "ghcr.io/kvfleet/kvfleet-server:0.1.0"
NOT_SUPPORTED = ("INFO kvfleet.server: start-up\nerror: not supported yet: --speculative-config "
                 "{\"method\": \"ngram\", \"num_speculative_tokens\": 4} (speculative decoding)\n")


def _status(name: str, state: dict, last: dict | None = None, restarts: int = 0, ready: bool = False) -> dict:
    return {"name": name, "ready": ready, "started": ready, "restartCount": restarts, "image": IMAGE,
            "imageID": "" if "waiting" in state and not last else "ghcr.io/kvfleet/kvfleet-server@sha256:" + "0" * 64,
            "state": state, "lastState": last or {}}


def pod(name: str, owner: str, *, containers: list[dict] | None = None, init: list[dict] | None = None,
        scheduled: tuple[str, str] | None = None, phase: str = "Running") -> dict:
    labels = render.common_labels(owner)
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if scheduled is not None:
        conditions = [{"type": "PodScheduled", "status": "False", "reason": scheduled[0], "message": scheduled[1]}]
    status: dict = {"phase": phase, "conditions": conditions}
    if containers is not None:
        status["containerStatuses"] = containers
    if init is not None:
        status["initContainerStatuses"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": labels,
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{owner}-abc",
                                              "uid": "rs-uid", "controller": True}]},
            "spec": {"containers": [{"name": render.SERVER_CONTAINER, "image": IMAGE}]},
            "status": status}


CRASH = [_status(render.SERVER_CONTAINER, {"waiting": {"reason": "CrashLoopBackOff",
                                                       "message": "back-off 40s restarting failed container"}},
                 {"terminated": {"exitCode": 2, "reason": "Error", "message": NOT_SUPPORTED}}, restarts=3)]
OOM = [_status(render.SERVER_CONTAINER, {"waiting": {"reason": "CrashLoopBackOff"}},
               {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}, restarts=2)]
PULL = [_status(render.SERVER_CONTAINER, {"waiting": {"reason": "ImagePullBackOff",
                                                      "message": f'Back-off pulling image "{IMAGE}"'}})]
ERR_PULL = [_status(render.SERVER_CONTAINER, {"waiting": {"reason": "ErrImagePull",
                                                          "message": "rpc error: code = NotFound"}})]
RUNNING = [_status(render.SERVER_CONTAINER, {"running": {"startedAt": "2026-12-01T00:00:00Z"}}, ready=True)]
GPU = ("Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available")

CASES = {
    "CrashLoopBackOff": (dict(containers=CRASH), "CrashLoopBackOff",
                         "last exit code 2): error: not supported yet: --speculative-config"),
    "OOMKilled": (dict(containers=OOM), "OOMKilled", "was OOMKilled (2 restarts)"),
    "ImagePullBackOff": (dict(containers=PULL), "ImagePullBackOff", "Back-off pulling image"),
    "ErrImagePull": (dict(containers=ERR_PULL), "ErrImagePull", "code = NotFound"),
    "Unschedulable": (dict(scheduled=GPU, phase="Pending"), "Unschedulable", "Insufficient nvidia.com/gpu"),
}


@pytest.mark.parametrize("case", CASES)
def test_pod_problem_classifies_each_failure(case):
    kwargs, reason, text = CASES[case]
    got = pods.pod_problem([pod("p-1", "m", containers=RUNNING), pod("p-2", "m", **kwargs)])
    assert got is not None and got[0] == reason and text in got[1] and "pod p-2" in got[1]


def test_pod_problem_ignores_healthy_finished_and_deleted_pods_and_orders_reasons():
    assert pods.pod_problem([pod("a", "m", containers=RUNNING)]) is None
    gone = pod("b", "m", containers=CRASH)
    gone["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert pods.pod_problem([gone, pod("c", "m", containers=CRASH, phase="Succeeded")]) is None
    both = [pod("d", "m", scheduled=GPU, phase="Pending"), pod("e", "m", containers=OOM)]
    assert pods.pod_problem(both)[0] == "OOMKilled"  # the most specific reason wins
    download = pod("f", "m", init=[_status("model-download", {"waiting": {"reason": "CrashLoopBackOff"}},
                                           {"terminated": {"exitCode": 1, "message": "401 Unauthorized\n"}})])
    assert pods.pod_problem([download]) == (
        "CrashLoopBackOff", "pod f: init container model-download is crash-looping (0 restarts, last exit code 1): "
                            "401 Unauthorized")


def _cpu_sample() -> dict:
    obj = yaml.safe_load((SAMPLES / "smollm2-135m-cpu.yaml").read_text())
    obj["metadata"]["namespace"] = "default"
    return obj


def _cond(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


@pytest.mark.parametrize("case", CASES)
async def test_failing_pods_degrade_within_seconds_and_recover(api, emulator, case):
    kwargs, reason, text = CASES[case]
    obj = _cpu_sample()
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
        await api.patch("apps/v1", "deployments", "default", name,
                        {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": 1,
                                    "updatedReplicas": 1, "readyReplicas": 0}}, subresource="status")

        async def waiting():  # settled: the model "is loading" — what the status said for 40 minutes before
            o = await api.get(AV, PL, "default", name)
            return o if _cond(o, "Ready").get("reason") == "WaitingForPods" else None
        await wait_for(waiting, timeout=10)
        # only the pod changes from here on: its watch must bring the failure to the status
        await api.create("v1", "pods", "default", pod(f"{name}-abc-1", name, **kwargs))

        async def degraded():
            o = await api.get(AV, PL, "default", name)
            return o if _cond(o, "Degraded").get("reason") == reason else None
        live = await wait_for(degraded, timeout=10)
        c = _cond(live, "Degraded")
        assert c["status"] == "True" and text in c["message"], c
        assert _cond(live, "Ready")["status"] == "False"

        # the pod recovers (a new image tag pulled, the flag removed, more memory...) and passes its probes
        healthy = pod(f"{name}-abc-1", name, containers=RUNNING)
        await api.patch("v1", "pods", "default", f"{name}-abc-1", {"status": healthy["status"]}, subresource="status")

        async def cleared():  # the pod's own event clears it, before the Deployment says anything
            o = await api.get(AV, PL, "default", name)
            return o if _cond(o, "Degraded").get("status") == "False" else None
        await wait_for(cleared, timeout=10)
        await api.patch("apps/v1", "deployments", "default", name, {"status": {"readyReplicas": 1,
                                                                               "availableReplicas": 1}},
                        subresource="status")

        async def recovered():
            o = await api.get(AV, PL, "default", name)
            return o if _cond(o, "Degraded").get("status") == "False" and _cond(o, "Ready").get("status") == "True" \
                else None
        live = await wait_for(recovered, timeout=10)
        assert _cond(live, "Degraded")["reason"] == "ReconcileSucceeded"


def test_rendered_pods_carry_the_owner_label_the_pod_watch_reads():
    dep = render.render({**_cpu_sample(), "metadata": {"name": "m", "namespace": "default"}}).deployment
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[render.OWNER_LABEL] == "m" and labels["app.kubernetes.io/managed-by"] == render.MANAGED_BY
    assert copy.deepcopy(labels) == render.common_labels("m")


def test_compute_status_reports_the_pod_problem_and_clears_it():
    from kvfleet_operator import status as st

    obj = {"metadata": {"name": "m", "generation": 1}, "status": {}}
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}}
    problem = pods.pod_problem([pod("m-1", "m", containers=CRASH)])
    bad = st.compute_status(obj, dep, 1, "u", "m", "s", "t1", False, problem=problem)
    d = st.get_condition(bad, st.DEGRADED)
    assert (d["status"], d["reason"]) == ("True", "CrashLoopBackOff") and "not supported yet" in d["message"]
    assert st.get_condition(bad, st.READY)["reason"] == "WaitingForPods"  # Ready keeps the rollout's view
    obj["status"] = bad
    good = st.compute_status(obj, dep, 1, "u", "m", "s", "t2", False, problem=None)
    d = st.get_condition(good, st.DEGRADED)
    assert (d["status"], d["reason"], d["lastTransitionTime"]) == ("False", "ReconcileSucceeded", "t2")


def test_volume_events_count_only_for_scheduled_pods_still_pending():
    def event(pod_name: str, reason: str = "FailedMount") -> dict:
        return {"type": "Warning", "reason": reason, "message": "MountVolume.SetUp failed for volume \"cache\"",
                "involvedObject": {"kind": "Pod", "name": pod_name}}

    waiting = pod("m-1", "m", phase="Pending")  # scheduled, containers not created yet
    started = pod("m-2", "m", containers=RUNNING)
    unscheduled = pod("m-3", "m", scheduled=GPU, phase="Pending")
    assert pods.starting_pods([waiting, started, unscheduled]) == ["m-1"]
    assert pods.event_selector("m-1") == "involvedObject.kind=Pod,involvedObject.name=m-1,type=Warning"
    assert pods.pod_problem([waiting], [event("m-1")]) == (
        "FailedMount", 'pod m-1: MountVolume.SetUp failed for volume "cache"')
    # an old Event of a pod that started since, or of a pod that is not ours, says nothing
    assert pods.pod_problem([started], [event("m-2")]) is None
    assert pods.pod_problem([waiting], [event("other-1"), event("m-1", "BackOff")]) is None
    # a crash-looping pod is more specific than another pod's volume trouble
    assert pods.pod_problem([waiting, pod("m-4", "m", containers=CRASH)],
                            [event("m-1", "FailedAttachVolume")])[0] == "CrashLoopBackOff"
