"""Integration: the real kopf runtime (KopfRunner) against KMock's API-server emulator on 127.0.0.1."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

from kmock_support import assert_operator_never_wrote_spec, running_operator, wait_for
from kvfleet_operator import api as isvc_api

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL


def sample(name: str, namespace: str = "default") -> dict:
    obj = yaml.safe_load((SAMPLES / name).read_text())
    obj["metadata"]["namespace"] = namespace
    return obj


def cond(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def wait_condition(api, name: str, type_: str, **fields: str) -> dict:
    """InferenceService ``default/name`` once its ``type_`` condition has ``fields`` (``status="True"``,
    ``reason=...``); AssertionError (naming the wait) after wait_for's timeout."""
    async def condition_met():
        o = await api.get(AV, PL, "default", name)
        c = cond(o, type_)
        return o if all(c.get(k) == v for k, v in fields.items()) else None
    condition_met.__name__ = f"{name}: {type_} {fields}"
    return await wait_for(condition_met)


async def test_a_sample_the_server_would_refuse_is_degraded_and_creates_nothing(api, emulator):
    obj = sample("llama-3.1-8b-instruct-draft.yaml")
    obj["spec"]["engine"]["dtype"] = "float16"  # on the CPU: refused by the server
    obj["spec"]["resources"] = {**obj["spec"].get("resources", {}), "gpus": 0}
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)

        live = await wait_condition(api, name, "Degraded", status="True")
        c = cond(live, "Degraded")
        assert c["reason"] == "UnsupportedFeature"
        assert c["message"].startswith("spec.engine.dtype: ") and "not supported yet" in c["message"]
        assert "float16 on CPU" in c["message"]
        assert await api.get("apps/v1", "deployments", "default", name) is None


async def test_sample_creates_children_and_status(api, emulator):
    # the 70B FP8 TP4 sample (tensor parallelism and FP8 have landed)
    obj = sample("llama-3.3-70b-instruct-fp8-tp4.yaml")
    name = obj["metadata"]["name"]
    async with running_operator():
        created = await api.create(AV, PL, "default", obj)
        # its shared model cache: the weights are downloaded once, by a Job, before any pod starts
        (job,) = await wait_for(lambda: api.list("batch/v1", "jobs", "default"))
        assert await api.get("apps/v1", "deployments", "default", name) is None
        await api.patch("batch/v1", "jobs", "default", job["metadata"]["name"],
                        {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}},
                        subresource="status")
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
        svc = await wait_for(lambda: api.get("v1", "services", "default", name))
        pdb = await wait_for(lambda: api.get("policy/v1", "poddisruptionbudgets", "default", name))
        for child in (dep, svc, pdb):
            (ref,) = child["metadata"]["ownerReferences"]
            assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] is True
            assert ref["kind"] == "InferenceService" and ref["name"] == name
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert dep["spec"]["replicas"] == 2
        live = await wait_for(lambda: api.get(AV, PL, "default", name))
        live = await wait_for(lambda: _with_status(api, name))
        assert live["status"]["url"] == f"http://{name}.default.svc:8000/v1"
        assert live["status"]["model"]["name"] == "meta-llama/Llama-3.3-70B-Instruct"
        assert live["status"]["observedGeneration"] == live["metadata"]["generation"] == 1
        assert cond(live, "Ready")["status"] == "False" and cond(live, "Progressing")["status"] == "True"

        # the Deployment controller reports the pods ready -> Ready=True
        await api.patch("apps/v1", "deployments", "default", name,
                        {"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": 2,
                                    "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}},
                        subresource="status")

        live = await wait_condition(api, name, "Ready", status="True")
        assert live["status"]["readyReplicas"] == 2 and cond(live, "Progressing")["status"] == "False"

        # change tensorParallelSize -> Deployment updated, observedGeneration follows generation
        await api.patch(AV, PL, "default", name, {"spec": {"engine": {"tensorParallelSize": 8},
                                                            "resources": {"gpus": 8}}})

        async def updated():
            d = await api.get("apps/v1", "deployments", "default", name)
            c = d["spec"]["template"]["spec"]["containers"][0]
            return d if c["resources"]["limits"]["nvidia.com/gpu"] == "8" else None
        dep = await wait_for(updated)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "8"

        async def observed():
            o = await api.get(AV, PL, "default", name)
            return o if o["status"].get("observedGeneration") == o["metadata"]["generation"] == 2 else None
        await wait_for(observed)

        # delete the Deployment -> recreated
        old_uid = dep["metadata"]["uid"]
        await api.delete("apps/v1", "deployments", "default", name)

        async def recreated():
            d = await api.get("apps/v1", "deployments", "default", name)
            return d if d and d["metadata"]["uid"] != old_uid else None
        await wait_for(recreated)

    # the spec was never written by the operator: only status and kopf's annotations
    final = await api.get(AV, PL, "default", name)
    expected = copy.deepcopy(obj["spec"])
    expected["engine"]["tensorParallelSize"] = 8
    expected["resources"]["gpus"] = 8
    assert final["spec"] == expected
    assert_operator_never_wrote_spec(emulator.writes)


async def _with_status(api, name):
    o = await api.get(AV, PL, "default", name)
    return o if o and (o.get("status") or {}).get("url") else None


async def test_unrealisable_spec_is_degraded_and_creates_nothing(api, emulator):
    """A GGUF path that is not in the repository (the reconcile pins the repository on the fake Hub and finds
    no such file): Degraded naming spec.model.uri, nothing created, no retry until the spec changes."""
    from kvfleet_operator import metrics

    obj = sample("llama-3.1-8b-instruct.yaml")
    obj["metadata"]["name"] = "gguf"
    obj["spec"]["model"]["uri"] = "hf://meta-llama/Llama-3.1-8B-Instruct/Llama-3.1-8B-Instruct-Q4_0.gguf"
    async with running_operator():
        await api.create(AV, PL, "default", obj)

        live = await wait_condition(api, "gguf", "Degraded", status="True")
        status_writes = _writes(emulator, PL, "status")
        passes = metrics.RECONCILES.labels(result="degraded")._value.get()
        # a permanent error: kopf does not retry (no new pass, no new status write while the spec is unchanged)
        await _settle()
        assert metrics.RECONCILES.labels(result="degraded")._value.get() == passes
        assert _writes(emulator, PL, "status") == status_writes
        assert not [w for w in emulator.writes if w["resource"] in ("deployments", "services", "poddisruptionbudgets")]
        # fixing the spec recovers: the file that is there is rendered, children created, Degraded cleared
        await api.patch(AV, PL, "default", "gguf", {"spec": {"model": {
            "uri": "hf://meta-llama/Llama-3.1-8B-Instruct/model-Q4_0.gguf"}}})
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", "gguf"))

        async def recovered():
            o = await api.get(AV, PL, "default", "gguf")
            return o if cond(o, "Degraded").get("status") == "False" and o["status"]["observedGeneration"] == 2 \
                else None
        fixed = await wait_for(recovered)
    c = cond(live, "Degraded")
    assert c["reason"] == "FileNotFound"
    assert c["message"].startswith("spec.model.uri: hf://meta-llama/Llama-3.1-8B-Instruct@main: no file "
                                   "'Llama-3.1-8B-Instruct-Q4_0.gguf' there; .gguf files present: model-Q4_0.gguf")
    assert cond(live, "Ready")["status"] == "False"
    commit = fixed["status"]["model"]["revision"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == f"/models/hf/meta-llama/Llama-3.1-8B-Instruct/{commit}/model-Q4_0.gguf"
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][:8] == ["hf", "meta-llama/Llama-3.1-8B-Instruct", "--revision", commit, "--dest",
                                f"/models/hf/meta-llama/Llama-3.1-8B-Instruct/{commit}", "--endpoint",
                                os.environ["HF_ENDPOINT"]]
    assert init["args"][8:10] == ["--file", "model-Q4_0.gguf"]


async def test_restart_makes_no_duplicates_and_no_writes(api, emulator):
    from kvfleet_operator import metrics

    obj = sample("llama-3.1-8b-instruct.yaml")
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        await wait_for(lambda: _with_status(api, name))
        await _settle()
    before = len(emulator.writes)
    done = metrics.RECONCILES.labels(result="success")._value.get()
    async with running_operator():
        await wait_for(lambda: metrics.RECONCILES.labels(result="success")._value.get() > done)  # resume ran
        await _settle()
    assert emulator.writes[before:] == []
    deployments = [k for k in emulator.objects if k[0].plural == "deployments" and not emulator.objects[k].deleted]
    assert len(deployments) == 1


async def test_kopf_state_survives_schema_pruning(api, emulator):
    from kvfleet_operator import admission

    obj = sample("smollm2-135m-cpu.yaml")
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        await wait_for(lambda: _with_status(api, "smollm2"))
        await _settle()
    live = await api.get(AV, PL, "default", "smollm2")
    schema = admission.schema()
    # everything the operator and kopf wrote is declared by the structural schema (nothing pruned) ...
    assert admission.prune(live["status"], schema["properties"]["status"]) == live["status"]
    assert admission.validate({k: v for k, v in live.items() if k != "status"}) == []
    # ... and kopf keeps nothing in the status (its handler progress goes to annotations, which pruning
    # never touches; its last-handled state stays in the operator's memory: ``diffbase``)
    notes = live["metadata"].get("annotations") or {}
    assert not [k for k in notes if k.startswith("kopf.serving.kvfleet.dev/")], notes
    assert "kopf" not in live["status"]


async def test_unbuilt_speculative_method_is_degraded_not_a_crash_looping_pod(api, emulator):
    """An object stored before the CRD narrowed its method enum (eagle3 was in the old sample) is refused when
    rendering: Degraded names the method, no Deployment is created."""
    obj = sample("llama-3.1-8b-instruct-draft.yaml")
    obj["metadata"]["name"] = "old-eagle3"
    obj["spec"]["engine"]["speculative"] = {"method": "eagle3", "numSpeculativeTokens": 5,
                                            "draftModel": "hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}
    async with running_operator():
        await api.create(AV, PL, "default", obj)

        live = await wait_condition(api, "old-eagle3", "Degraded", status="True")
        await _settle()
        assert not [w for w in emulator.writes if w["resource"] == "deployments"]
    c = cond(live, "Degraded")
    assert "spec.engine.speculative.method: not supported yet: --speculative-config method 'eagle3'" in c["message"]


async def test_autoscaled_replicas_are_not_reset(api, emulator):
    obj = sample("llama-3.1-8b-instruct-draft.yaml")
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
        assert dep["spec"]["replicas"] == 1  # minReplicas
        assert await wait_for(lambda: api.get("policy/v1", "poddisruptionbudgets", "default", name))  # max 4 > 1
        # the autoscaler scales the Deployment to 3; then the user edits the spec
        await api.patch("apps/v1", "deployments", "default", name, {"spec": {"replicas": 3}})
        await api.patch(AV, PL, "default", name, {"spec": {"engine": {"maxModelLen": 4096}}})

        async def rendered():
            d = await api.get("apps/v1", "deployments", "default", name)
            return d if "4096" in d["spec"]["template"]["spec"]["containers"][0]["args"] else None
        dep = await wait_for(rendered)
        assert dep["spec"]["replicas"] == 3
        # lowering maxReplicas below the current count clamps it
        await api.patch(AV, PL, "default", name, {"spec": {"autoscaling": {"maxReplicas": 2}}})

        async def clamped():
            d = await api.get("apps/v1", "deployments", "default", name)
            return d if d["spec"]["replicas"] == 2 else None
        await wait_for(clamped)


async def test_pdb_follows_replicas_and_delete_leaves_no_finalizer(api, emulator):
    obj = sample("llama-3.1-8b-instruct.yaml")
    obj["spec"]["replicas"] = 2
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        await wait_for(lambda: api.get("policy/v1", "poddisruptionbudgets", "default", name))
        await api.patch(AV, PL, "default", name, {"spec": {"replicas": 1}})

        async def pdb_gone():
            return await api.get("policy/v1", "poddisruptionbudgets", "default", name) is None
        await wait_for(pdb_gone)
        dep = await api.get("apps/v1", "deployments", "default", name)
        assert dep["spec"]["replicas"] == 1
        live = await api.get(AV, PL, "default", name)
        assert not live["metadata"].get("finalizers")  # no deletion handler -> nothing blocks deletion
        await api.delete(AV, PL, "default", name)

        async def gone():
            return await api.get(AV, PL, "default", name) is None
        await wait_for(gone)


def _writes(emulator, resource, subresource=None):
    return [w for w in emulator.writes if w["resource"] == resource and w["subresource"] == subresource]


async def _settle(seconds: float = 1.0):
    """Let the operator process what is in flight (bounded; used only to show nothing more happens)."""
    import asyncio
    await asyncio.sleep(seconds)


async def test_api_errors_are_retried_and_child_edits_reverted(api, emulator):
    from kvfleet_operator import metrics

    errors = metrics.ERRORS.labels(reason="InjectedFault")._value.get()
    emulator.inject_fault("POST", "deployments", times=1, status=500)
    obj = sample("smollm2-135m-cpu.yaml")
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"), timeout=20)
        assert metrics.ERRORS.labels(reason="InjectedFault")._value.get() == errors + 1
        # someone edits the server's image in the Deployment: the operator puts the spec's back
        box = dep["spec"]["template"]["spec"]["containers"][0]
        edited = {**box, "image": "evil:latest"}
        await api.patch("apps/v1", "deployments", "default", "smollm2",
                        {"spec": {"template": {"spec": {"containers": [edited]}}}})

        async def reverted():
            d = await api.get("apps/v1", "deployments", "default", "smollm2")
            return d if d["spec"]["template"]["spec"]["containers"][0]["image"] == "kvfleet-server:cpu" else None
        dep = await wait_for(reverted)
        # the Deployment is deleted while the API server refuses the re-create once: retried, recreated
        emulator.inject_fault("POST", "deployments", times=1, status=503)
        await api.delete("apps/v1", "deployments", "default", "smollm2")

        async def recreated():
            d = await api.get("apps/v1", "deployments", "default", "smollm2")
            return d if d and d["metadata"]["uid"] != dep["metadata"]["uid"] else None
        await wait_for(recreated)
        assert metrics.ERRORS.labels(reason="InjectedFault")._value.get() == errors + 2


async def test_liveness_endpoint(api, emulator, unused_tcp_port):
    import aiohttp
    from kmock_support import fast_settings
    from kopf.testing import KopfRunner
    import asyncio

    runner = KopfRunner(["run", "-A", "--standalone", "-m", "kvfleet_operator.handlers",
                         f"--liveness=http://127.0.0.1:{unused_tcp_port}/healthz"], timeout=30,
                        settings=fast_settings())
    await asyncio.to_thread(runner.__enter__)
    try:
        async def healthy():
            try:
                async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{unused_tcp_port}/healthz") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False
        await wait_for(healthy)
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)


async def test_orphans_adopted_foreign_objects_refused_scale_subresource(api, emulator):
    from kvfleet_operator import render

    # an orphan of an earlier InferenceService "orphan" (deleted with --cascade=orphan): adopted
    await api.create("v1", "services", "default", {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "orphan", "namespace": "default",
        "labels": {**render.common_labels("orphan"), "extra": "kept"}}, "spec": {"ports": [{"port": 1}]}})
    # somebody else's Deployment with the name of a new InferenceService: refused, left alone
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "taken", "namespace": "default", "labels": {"app": "mine"}},
               "spec": {"replicas": 1}}
    await api.create("apps/v1", "deployments", "default", foreign)
    async with running_operator():
        for name in ("orphan", "taken"):
            obj = sample("smollm2-135m-cpu.yaml")
            obj["metadata"]["name"] = name
            await api.create(AV, PL, "default", obj)

        async def adopted():
            svc = await api.get("v1", "services", "default", "orphan")
            return svc if svc["metadata"].get("ownerReferences") else None
        svc = await wait_for(adopted)
        assert svc["spec"]["ports"][0]["name"] == "http" and svc["metadata"]["labels"]["extra"] == "kept"

        live = await wait_condition(api, "taken", "Degraded", reason="ChildConflict")
        assert "Deployment default/taken exists and is not controlled by this InferenceService" in \
            cond(live, "Degraded")["message"]
        assert (await api.get("apps/v1", "deployments", "default", "taken"))["spec"] == foreign["spec"]
        assert await api.get("v1", "services", "default", "taken") is None  # nothing created for it
        # removing the object in the way is enough: the conflict is retried with backoff
        await api.delete("apps/v1", "deployments", "default", "taken")

        await wait_condition(api, "taken", "Degraded", status="False")
        dep = await api.get("apps/v1", "deployments", "default", "taken")
        assert dep["metadata"]["ownerReferences"][0]["name"] == "taken"

        # `kubectl scale infsvc/orphan --replicas=3` goes through the scale subresource
        await api.patch(AV, PL, "default", "orphan", {"spec": {"replicas": 3}}, subresource="scale")

        async def scaled():
            d = await api.get("apps/v1", "deployments", "default", "orphan")
            return d if d and d["spec"]["replicas"] == 3 else None
        await wait_for(scaled)
        assert await wait_for(lambda: api.get("policy/v1", "poddisruptionbudgets", "default", "orphan"))


async def test_child_refused_as_invalid_is_degraded_without_retries(api, emulator):
    """A 422 from the API server (a rendered child it refuses, e.g. a malformed affinity in the spec)
    cannot be fixed by retrying: Degraded ChildInvalid with the server's message, then quiet."""
    from kvfleet_operator import metrics

    emulator.inject_fault("POST", "deployments", times=1000, status=422)
    obj = sample("smollm2-135m-cpu.yaml")
    async with running_operator():
        await api.create(AV, PL, "default", obj)

        live = await wait_condition(api, "smollm2", "Degraded", reason="ChildInvalid")
        assert "the API server refused the Deployment: injected by the test (422)" in cond(live, "Degraded")["message"]
        passes = metrics.RECONCILES.labels(result="degraded")._value.get()
        await _settle()
        assert metrics.RECONCILES.labels(result="degraded")._value.get() == passes
        # the user fixes the spec (here: the API server stops refusing): recovered
        emulator.faults.clear()
        await api.patch(AV, PL, "default", "smollm2", {"spec": {"replicas": 2}})
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"))


async def test_children_of_an_object_being_deleted_are_not_recreated(api, emulator):
    """While an InferenceService is being deleted (deletionTimestamp set, another finalizer holding it),
    the garbage collector removes its children: the operator must not fight it by recreating them."""
    obj = sample("smollm2-135m-cpu.yaml")
    obj["metadata"]["finalizers"] = ["example.com/hold"]
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        await wait_for(lambda: api.get("v1", "services", "default", "smollm2"))
        await wait_for(lambda: api.get("apps/v1", "deployments", "default", "smollm2"))
        await api.delete(AV, PL, "default", "smollm2")

        async def deleting():
            o = await api.get(AV, PL, "default", "smollm2")
            return o if o and o["metadata"].get("deletionTimestamp") else None
        await wait_for(deleting)
        await api.delete("apps/v1", "deployments", "default", "smollm2")  # what the garbage collector does
        await _settle()
        assert await api.get("apps/v1", "deployments", "default", "smollm2") is None
        await api.patch(AV, PL, "default", "smollm2", {"metadata": {"finalizers": None}})

        async def gone():
            return await api.get(AV, PL, "default", "smollm2") is None
        await wait_for(gone)
