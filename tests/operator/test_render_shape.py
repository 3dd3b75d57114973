"""GPU pods shaped for production, and strict children (issue 34, must-show 2 and 4).

- GPU pods request CPU and memory per GPU, tensor-parallel pods get a memory-backed /dev/shm with a size
  limit counted in the memory request, replicas spread across nodes (ScheduleAnyway), rolling updates
  need no spare GPU, the PDB lets unhealthy pods be evicted; every default is overridable (spec fields,
  operator settings) and the renderings pass kubernetes-validate strict for 1.30 and 1.35.
- Unknown fields in the core/v1 structures the spec passes through (affinity, topologySpreadConstraints)
  or in the typed ones (tolerations, env) are refused at render, naming the spec path.
"""
from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvfleet_operator import admission, cli, render, strict

HF = {"model": {"uri": "hf://meta-llama/Llama-3.3-70B-Instruct"}}
KUBE_VERSIONS = ("1.30", "1.35")


def isvc(spec: dict, name: str = "m") -> dict:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns", "uid": "u-1"}, "spec": spec}


def pod(children: render.Children) -> dict:
    return children.deployment["spec"]["template"]["spec"]


def resources(children: render.Children) -> dict:
    return pod(children)["containers"][0]["resources"]


def shm(children: render.Children) -> dict | None:
    return next((v["emptyDir"] for v in pod(children)["volumes"] if v["name"] == "dshm"), None)


def refusal(spec: dict, **kw) -> render.Unrealisable:
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc(spec), **kw)
    return err.value


# --------------------------------------------------------------------------- GPU pods for production
@pytest.mark.parametrize("tp, cpu, memory, shm_limit", [
    (1, "4", "24Gi", None), (2, "8", "50Gi", "2Gi"), (4, "16", "100Gi", "4Gi"), (8, "32", "200Gi", "8Gi")])
def test_gpu_pods_request_cpu_memory_and_shm_per_gpu(tp, cpu, memory, shm_limit):
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": tp}, "replicas": 2}))
    assert resources(c) == {"limits": {"nvidia.com/gpu": str(tp)}, "requests": {"cpu": cpu, "memory": memory}}
    if shm_limit is None:
        assert shm(c) is None
    else:
        assert shm(c) == {"medium": "Memory", "sizeLimit": shm_limit}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod(c)["containers"][0]["volumeMounts"]
    for child in (c.deployment, c.service, c.pdb):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(child, version, strict=True)


def test_replicas_spread_across_nodes_and_roll_without_spare_gpus():
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": 4}, "replicas": 3}, name="chat"))
    assert pod(c)["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": c.deployment["spec"]["selector"]["matchLabels"]},
        "matchLabelKeys": ["pod-template-hash"]}]
    # the spread counts the InferenceService's own pods, whose labels the template carries
    assert c.deployment["spec"]["selector"]["matchLabels"].items() <= \
        c.deployment["spec"]["template"]["metadata"]["labels"].items()
    # a surge pod would need a spare GPU: none is created before an old pod goes
    assert c.deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_pdb_never_blocks_a_drain_on_an_unhealthy_pod():
    c = render.render(isvc({**HF, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}))
    assert c.pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert c.pdb["spec"]["maxUnavailable"] == 1
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(c.pdb, version, strict=True)


def test_spec_overrides_every_default():
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
               "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "m"}}}]
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": 2},
                            "resources": {"cpu": "6500m", "memory": "100Gi", "shmSize": "16Gi"},
                            "scheduling": {"topologySpreadConstraints": spread}}))
    assert resources(c) == {"limits": {"nvidia.com/gpu": "2", "memory": "100Gi"},
                            "requests": {"cpu": "6500m", "memory": "100Gi"}}
    assert shm(c) == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert pod(c)["topologySpreadConstraints"] == spread
    none = render.render(isvc({**HF, "scheduling": {"topologySpreadConstraints": []}}))
    assert "topologySpreadConstraints" not in pod(none)
    # a /dev/shm on request also without tensor parallelism (e.g. a library that shares tensors through it)
    assert shm(render.render(isvc({**HF, "resources": {"shmSize": "512Mi"}}))) == {"medium": "Memory",
                                                                                   "sizeLimit": "512Mi"}


def test_operator_settings_override_the_per_gpu_defaults():
    defaults = render.ServingDefaults.from_env({"KVFLEET_CPU_PER_GPU": "2500m", "KVFLEET_MEMORY_PER_GPU": "80Gi",
                                                "KVFLEET_SHM_PER_GPU": "512Mi"})
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": 2}}), defaults=defaults)
    assert resources(c)["requests"] == {"cpu": "5", "memory": "161Gi"}  # 2 x 80Gi + 2 x 512Mi
    assert shm(c)["sizeLimit"] == "1Gi"
    odd = render.ServingDefaults(cpu_per_gpu="1100m", memory_per_gpu="1000M", shm_per_gpu="1")
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": 4}}), defaults=odd)
    assert resources(c)["requests"] == {"cpu": "4400m", "memory": "4000000004"}  # exact: millicores, bytes
    for var in ("KVFLEET_CPU_PER_GPU", "KVFLEET_MEMORY_PER_GPU", "KVFLEET_SHM_PER_GPU"):
        with pytest.raises(ValueError, match=var):
            render.ServingDefaults.from_env({var: "lots"})
        with pytest.raises(ValueError, match=var):
            render.ServingDefaults.from_env({var: "0"})


def test_cpu_pods_get_no_gpu_defaults():
    c = render.render(isvc({"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}))
    assert resources(c) == {} and shm(c) is None


def test_memory_must_exceed_shared_memory():
    err = refusal({**HF, "engine": {"tensorParallelSize": 8}, "resources": {"memory": "8Gi"}})
    assert err.reason == "InvalidSpec"
    assert err.message.startswith("spec.resources.memory (8Gi) must exceed the /dev/shm size (8Gi, "
                                  "spec.resources.shmSize)")
    assert refusal({**HF, "resources": {"memory": "1Gi", "shmSize": "2Gi"}}).reason == "InvalidSpec"


def test_fewer_gpus_than_tensor_parallel_ranks_is_refused_naming_the_field():
    err = refusal({**HF, "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}})
    assert err.reason == "InvalidSpec" and "spec.resources.gpus (2) must be >= spec.engine.tensorParallelSize (4)" \
        in err.message
    obj = isvc({**HF, "engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}})
    assert [e for e in admission.validate(obj) if "spec.resources.gpus must be >= " in e]  # the CRD's CEL rule
    # more GPUs than ranks is allowed (docs/operator.md says why one would)
    more = render.render(isvc({**HF, "engine": {"tensorParallelSize": 2}, "resources": {"gpus": 4}}))
    assert resources(more)["limits"]["nvidia.com/gpu"] == "4" and resources(more)["requests"]["cpu"] == "16"


def test_quantities_are_printed_as_kubernetes_does():
    from decimal import Decimal

    fmt = render.format_quantity
    assert [fmt(Decimal(v), binary=False) for v in ("4", "0.5", "2.0005", "16")] == ["4", "500m", "2001m", "16"]
    assert [fmt(Decimal(v), binary=True) for v in (2 ** 30 * 100, 2 ** 20 * 1536, 1000, 2 ** 40)] == \
        ["100Gi", "1536Mi", "1000", "1Ti"]


# ----------------------------------------------------------------------------------- strict children
AFFINITY_TYPOS = [
    ({"nodeAffinty": {}}, "spec.scheduling.affinity.nodeAffinty: unknown field"),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpresions": [{"key": "a", "operator": "In", "values": ["b"]}]}]}}},
     "spec.scheduling.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
     ".matchExpresions: unknown field"),
    ({"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelecter": {}}}]}},
     "spec.scheduling.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm"
     ".labelSelecter: unknown field"),
    ({"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": 7}]}},
     "spec.scheduling.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey: "
     "7 is not of type 'string'"),
]


@pytest.mark.parametrize("affinity, message", AFFINITY_TYPOS, ids=["top", "nested-list", "deep", "type"])
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_unknown_fields_in_affinity_are_refused_naming_the_path(affinity, message, version):
    err = refusal({**HF, "scheduling": {"affinity": affinity}}, kubernetes_version=version)
    assert err.reason == "InvalidSpec"
    assert err.message == f"{message} (the Kubernetes {version} schema)"


def test_unknown_fields_in_spread_constraints_and_typed_structures_are_refused():
    err = refusal({**HF, "scheduling": {"topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway", "labelSelectr": {}}]}})
    assert err.reason == "InvalidSpec"
    assert err.message.startswith("spec.scheduling.topologySpreadConstraints[0].labelSelectr: unknown field")
    missing = refusal({**HF, "scheduling": {"topologySpreadConstraints": [{"maxSkew": 1}]}})
    assert "spec.scheduling.topologySpreadConstraints[0]: 'topologyKey' is a required property" in missing.message
    # typed structures: the spec models themselves refuse unknown fields, naming the path
    tol = refusal({**HF, "scheduling": {"tolerations": [{"key": "gpu", "tolerationSecond": 5}]}})
    assert tol.reason == "InvalidSpec" and "spec.scheduling.tolerations[0].tolerationSecond" in tol.message
    env = refusal({**HF, "engine": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k",
                                                                                          "optinal": True}}}]}})
    assert env.reason == "InvalidSpec" and "spec.engine.env[0].valueFrom.secretKeyRef.optinal" in env.message


def test_every_problem_is_named_once_and_valid_structures_pass():
    affinity = {"nodeAffinty": {}, "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelecter": {}}]}}
    err = refusal({**HF, "scheduling": {"affinity": affinity}})
    assert err.message.count("unknown field") == 2 and "nodeAffinty" in err.message and "labelSelecter" in err.message
    good = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "m"}},
        "matchLabelKeys": ["pod-template-hash"]}}]}}
    assert pod(render.render(isvc({**HF, "scheduling": {"affinity": good}})))["affinity"] == good


def test_a_problem_no_spec_field_maps_to_names_the_child():
    dep = render.render(isvc(HF)).deployment
    broken = {**dep, "spec": {**dep["spec"], "revisionHistoryLimitt": 3}}
    assert strict.check([broken], "1.30") == [(None, "Deployment spec.revisionHistoryLimitt: unknown field")]
    assert strict.check([dep], "1.30") == []


def test_results_are_remembered_by_digest_within_a_bound(monkeypatch):
    monkeypatch.setattr(strict, "MEMO_SIZE", 2)
    monkeypatch.setattr(strict, "_memo", type(strict._memo)())
    dep = render.render(isvc(HF)).deployment
    calls = []
    real = strict.problems
    monkeypatch.setattr(strict, "problems", lambda child, version: calls.append(child["kind"]) or real(child, version))
    typo = {**dep, "spec": {**dep["spec"], "minReadySecond": 1}}
    first = strict.check([typo], "1.30")
    first.append("caller's own list")
    assert strict.check([typo], "1.30") == [(None, "Deployment spec.minReadySecond: unknown field")]
    assert calls == ["Deployment"]  # the second check was remembered
    strict.check([typo], "1.35")  # another version: validated again
    strict.check([dep], "1.30")
    assert calls == ["Deployment"] * 3 and len(strict._memo) == 2  # bounded: the oldest result was dropped
    strict.check([typo], "1.30")
    assert len(calls) == 4


def test_services_differing_only_in_name_and_uid_share_one_validation(monkeypatch):
    monkeypatch.setattr(strict, "_memo", type(strict._memo)())
    calls = []
    real = strict.problems
    monkeypatch.setattr(strict, "problems", lambda child, version: calls.append(child["kind"]) or real(child, version))

    def named(name: str, affinity: dict | None = None) -> dict:
        obj = isvc({**HF, **({"scheduling": {"affinity": affinity}} if affinity else {})})
        obj["metadata"].update(name=name, uid=f"uid-{name}")
        return obj
    for name in ("a", "b", "c"):
        render.render(named(name))
    assert calls == ["Deployment", "Service"]  # the first one's children only
    # a problem next to a value equal to the name: reported with the object's own strings
    typo = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": "heavy",
            "podAffinityTerm": {"topologyKey": "x", "labelSelector": {"matchLabels": {"app": "b"}}}}]}}
    with pytest.raises(render.Unrealisable, match=r"spec\.scheduling\.affinity\.podAntiAffinity\.preferred.*'heavy' is not of type 'integer'"):
        render.render(named("b", typo))
    # a problem at a value equal to the name: the message shows the name, not the placeholder
    with pytest.raises(render.Unrealisable) as exc:
        render.render(named("b", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "b"}}))
    assert "requiredDuringSchedulingIgnoredDuringExecution: 'b' is not of type 'object'" in exc.value.message
    assert "instance" not in exc.value.message
    # a value an enum of the schema allows is validated as it is, never as the placeholder
    dep = render.render(isvc(HF)).deployment
    assert strict.check([dep], "1.30", instance=("Deployment", "apps/v1")) == []  # the kind and apiVersion enums


@pytest.mark.parametrize("server, schema", [("1.26", "1.30"), ("1.29+", "1.30"), ("v1.35.2", "1.35"),
                                            ("1.31", "1.31"), ("1.99", strict.NEWEST), (None, strict.NEWEST),
                                            ("", strict.NEWEST)])
def test_schema_version_follows_the_api_server(server, schema):
    assert strict.kubernetes_version(server) == schema


def _render_cli(obj: dict, *args: str, tmp_path: Path) -> tuple[int, str, str]:
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(obj))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["render", str(path), *args])
    return rc, out.getvalue(), err.getvalue()


def test_render_command_refuses_a_typo_naming_the_path(tmp_path):
    obj = isvc({**HF, "scheduling": {"affinity": {"nodeAffinty": {}}}}, name="typo")
    rc, out, err = _render_cli(obj, "--kubernetes-version", "1.30", tmp_path=tmp_path)
    assert rc == 2 and out == ""
    assert err == "error: typo: InvalidSpec: spec.scheduling.affinity.nodeAffinty: unknown field " \
                  "(the Kubernetes 1.30 schema)\n"


def test_render_command_uses_the_operator_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CPU_PER_GPU", "8")
    rc, out, _ = _render_cli(isvc(HF), tmp_path=tmp_path)
    dep = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    assert rc == 0 and dep["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "8"
    monkeypatch.setenv("KVFLEET_MEMORY_PER_GPU", "-1")
    rc, _, err = _render_cli(isvc(HF), tmp_path=tmp_path)
    assert rc == 2 and "KVFLEET_MEMORY_PER_GPU" in err
