"""The shared model cache on KMock with the real kopf runtime; the Jobs' and pods' status is played by the test.

One download Job per pinned revision; the Deployment (pods mounting the claim read-only) only after the Job
succeeded; ModelReady Downloading (bytes read from the downloader's own progress gauges) -> Loading -> Ready;
a new revision gets a new Job while the old revision keeps serving, and the old Job goes; a failed download is
Degraded naming the field; deleting the InferenceService deletes the Job and the claim (owner references,
honoured by the emulator's garbage collection as by a real API server's).
"""
from __future__ import annotations

import asyncio
import copy

import pytest

from kmock_support import assert_operator_never_wrote_spec, running_operator, wait_for
from model_stores import free_port
from kvfleet_operator import api as isvc_api
from kvfleet_operator import cache

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
REPO = "org/cached"
FILES = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors": b"\0" * 64,
         "original/consolidated.pth": b"\0" * 128}


def isvc(name: str = "cached") -> dict:
    return {"apiVersion": AV, "kind": isvc_api.KIND, "metadata": {"name": name, "namespace": "default"},
            "spec": {"model": {"uri": f"hf://{REPO}", "credentialsSecret": "hub-token"},
                     "modelCache": {"shared": {"size": "10Gi", "storageClassName": "nfs"}},
                     "resources": {"gpus": 0, "cpu": "1"}}}


def cond(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def model_ready(api, name: str, reason: str, contains: str = "") -> dict:
    async def check():
        o = await api.get(AV, PL, "default", name)
        c = cond(o, "ModelReady")
        return o if c.get("reason") == reason and contains in (c.get("message") or "") else None
    check.__name__ = f"ModelReady {reason} {contains!r}"
    return await wait_for(check)


async def jobs(api) -> list[dict]:
    return await api.list("batch/v1", "jobs", "default")


async def finish(api, job: dict, ok: bool = True) -> None:
    """Play the Job controller: the Job succeeded (or failed)."""
    status = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]} if ok else \
        {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]}
    await api.patch("batch/v1", "jobs", "default", job["metadata"]["name"], {"status": status}, subresource="status")


def download_pod(job: dict, phase: str, port: int | None = None, message: str | None = None) -> dict:
    """The pod the Job controller would create from the Job's template, with the kubelet's status."""
    tpl = copy.deepcopy(job["spec"]["template"])
    box = tpl["spec"]["containers"][0]
    if port is not None:  # the downloader's gauges, served by the test on a free port of 127.0.0.1
        box["ports"] = [{"name": cache.PROGRESS_PORT_NAME, "containerPort": port, "protocol": "TCP"}]
    state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if phase == "Running" else \
        {"terminated": {"exitCode": 3, "reason": "Error", "message": message or ""}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": job["metadata"]["name"] + "-x1", "namespace": "default",
                         "labels": tpl["metadata"]["labels"],
                         "resourceVersion": "1"},
            "spec": tpl["spec"],
            "status": {"phase": phase, "podIP": "127.0.0.1",
                       "containerStatuses": [{"name": box["name"], "image": box["image"], "imageID": "", "ready": False,
                                              "restartCount": 0, "state": state}]}}


async def test_one_job_per_revision_then_pods_then_a_new_revision(api, emulator, fake_hub, tmp_path):
    from kvfleet_server.download import Progress

    c1 = fake_hub.commit(REPO, FILES)
    async with running_operator():
        created = await api.create(AV, PL, "default", isvc())
        uid = created["metadata"]["uid"]

        # one Job for the pinned commit, a claim, no Deployment: no pod starts before its weights are there
        (job,) = await wait_for(lambda: jobs(api))
        live = await model_ready(api, "cached", "Downloading")
        assert live["status"]["model"] == {"name": REPO, "revision": c1, "generation": 1, "sources": [
            {"field": "spec.model.uri", "uri": f"hf://{REPO}", "revision": c1}]}
        assert job["metadata"]["annotations"][cache.REVISION_ANNOTATION] == c1
        assert job["metadata"]["ownerReferences"][0]["uid"] == uid
        box = job["spec"]["template"]["spec"]["containers"][0]
        assert box["command"] == ["kvfleet-download"] and box["args"][:4] == ["hf", REPO, "--revision", c1]
        assert box["envFrom"] == [{"secretRef": {"name": "hub-token"}}]  # the credentials: this container only
        pvc = await api.get("v1", "persistentvolumeclaims", "default", "cached-model-cache")
        assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}},
                               "storageClassName": "nfs"}
        assert pvc["metadata"]["ownerReferences"][0]["uid"] == uid
        assert await api.get("apps/v1", "deployments", "default", "cached") is None

        # the download runs: ModelReady reads its progress gauges (the downloader's own exporter)
        (tmp_path / "part").write_bytes(b"\1" * (1 << 20))
        progress = Progress(str(tmp_path), port := free_port())
        progress.expected.set(4 << 20)
        progress.stop()  # refresh once: 1 MiB on disk
        await api.create("v1", "pods", "default", download_pod(job, "Running", port))
        await model_ready(api, "cached", "Downloading", f"hf://{REPO}@{c1[:12]}: 1.0 MiB of 4.0 MiB (25%)")
        assert await api.get("apps/v1", "deployments", "default", "cached") is None

        # the Job succeeds: the Deployment appears, its pods mount the claim read-only, ModelReady Loading
        await finish(api, job)
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", "cached"))
        pod = dep["spec"]["template"]["spec"]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cached-model-cache",
                                                                "readOnly": True}} in pod["volumes"]
        server = pod["containers"][0]
        assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
        assert server["args"][server["args"].index("--model") + 1] == f"/models/hf/{REPO}/{c1}"
        assert "initContainers" not in pod and "envFrom" not in server
        await model_ready(api, "cached", "Loading")

        # the pods are ready: ModelReady True
        await api.patch("apps/v1", "deployments", "default", "cached",
                        {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": 1,
                                    "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
                        subresource="status")
        live = await model_ready(api, "cached", "Ready")
        assert cond(live, "ModelReady")["status"] == "True" and cond(live, "Ready")["status"] == "True"

        # main moves; a new generation pins the new commit: a new Job (keeping c1, which still serves), the old
        # Job goes; the other change of that generation (maxNumSeqs) rolls out at once, on c1
        c2 = fake_hub.commit(REPO, {**FILES, "config.json": b'{"v": 2}'})
        await api.patch(AV, PL, "default", "cached", {"spec": {"engine": {"maxNumSeqs": 32}}})

        async def new_job():
            found = await jobs(api)
            return found if [j["metadata"]["annotations"][cache.REVISION_ANNOTATION] for j in found] == [c2] else None
        (job2,) = await wait_for(new_job)
        args2 = job2["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args2[args2.index("--prune"):args2.index("--prune") + 3] == ["--prune", "--keep", c1]

        async def rolled(rev, seqs):
            d = await api.get("apps/v1", "deployments", "default", "cached")
            a = d["spec"]["template"]["spec"]["containers"][0]["args"]
            return d if a[a.index("--model") + 1] == f"/models/hf/{REPO}/{rev}" and seqs in a else None
        await wait_for(lambda: rolled(c1, "32"))
        live = await model_ready(api, "cached", "Downloading")
        assert live["status"]["model"]["revision"] == c2 and live["status"]["model"]["generation"] == 2

        await finish(api, job2)
        await wait_for(lambda: rolled(c2, "32"))
        assert [j["metadata"]["name"] for j in await jobs(api)] == [job2["metadata"]["name"]]
        live = await model_ready(api, "cached", "Loading", c2[:12])  # the new pods load c2
        # the progress timer's finalizer goes with the download: kopf removes it when it processes the
        # event whose status no longer says Downloading, which may come after this read
        async def no_finalizer():
            return not (await api.get(AV, PL, "default", "cached"))["metadata"].get("finalizers")
        await wait_for(no_finalizer)

        # deleting the InferenceService deletes its Job and its claim (garbage collection by owner reference)
        await api.delete(AV, PL, "default", "cached")

        async def collected():
            return await api.get(AV, PL, "default", "cached") is None and not await jobs(api) and \
                await api.get("v1", "persistentvolumeclaims", "default", "cached-model-cache") is None
        await wait_for(collected)
        await asyncio.sleep(1)  # a pass queued behind the deletion must not create them again
        assert await collected()
    assert_operator_never_wrote_spec(emulator.writes)


@pytest.mark.parametrize("line,reason,field", [
    ("error: Unauthorized: hf://org/cached@abc: the Hub refused the token (HTTP 403)", "Unauthorized",
     "spec.model.credentialsSecret"),
    ("error: DiskFull: hf://org/cached@abc: no space left on the model cache volume (No space left on device)",
     "DiskFull", "spec.modelCache.shared.size"),
])
async def test_a_failed_download_is_degraded_naming_the_field(api, emulator, fake_hub, line, reason, field):
    fake_hub.commit(REPO, FILES)
    async with running_operator():
        await api.create(AV, PL, "default", isvc())
        (job,) = await wait_for(lambda: jobs(api))
        await api.create("v1", "pods", "default", download_pod(job, "Failed", message=f"fetching\n{line}\n"))
        await finish(api, job, ok=False)

        async def degraded():
            o = await api.get(AV, PL, "default", "cached")
            return o if cond(o, "Degraded").get("reason") == reason else None
        live = await wait_for(degraded)
    c = cond(live, "Degraded")
    assert c["status"] == "True" and c["message"] == f"{field}: {line.split(': ', 2)[2]}"
    assert cond(live, "ModelReady")["reason"] == "DownloadFailed"
    assert await api.get("apps/v1", "deployments", "default", "cached") is None
