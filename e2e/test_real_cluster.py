"""The operator against a real Kubernetes API server (what KMock cannot show): the CRD's structural schema
and CEL rules, fieldValidation=Strict, the chart's RBAC (the operator runs with its ServiceAccount's token),
the scale subresource, `kubectl wait`, garbage collection by the controller-manager, and the status
through a rollout, a quota refusal, a crash loop and an invalid embedded structure.

Run: ``KVFLEET_E2E_KUBECONFIG=PATH pytest e2e/test_real_cluster.py`` against any cluster whose admin
kubeconfig that is (kind, a cloud cluster, or a bare kube-apiserver + kube-controller-manager: the suite
plays the kubelet through ``pods/status``). Skipped, with the reason, without it. The scale mode
(``KVFLEET_E2E_SCALE=1000``) creates that many InferenceServices and reports the operator's latency,
memory and writes at rest.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from real_cluster import (GROUP, OPERATOR_NS, PLURAL, VERSION, Cluster, Kubelet, Operator, Progress,
                          apiserver_requests, counts_delta, install, isvc, operator_requests,
                          skip_reason, wait_for)

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]
SELECTOR = "app.kubernetes.io/name=kvfleet-server,app.kubernetes.io/instance={}"


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    c = Cluster(os.environ["KVFLEET_E2E_KUBECONFIG"])
    install(c)
    return c


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    op = Operator(cluster, tmp_path_factory.mktemp("operator"))
    wait_for("the operator's liveness endpoint", lambda: _alive(op), timeout=60)
    yield op
    op.stop()
    print(f"\noperator log: {op.log_path}")


def _alive(op: Operator) -> bool:
    import httpx
    assert op.proc.poll() is None, Path(op.log_path).read_text()[-3000:]
    try:
        return httpx.get(f"http://127.0.0.1:{op.health_port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def ns(cluster):
    name = cluster.namespace(f"e2e-{uuid.uuid4().hex[:6]}")
    yield name
    for pod in cluster.core.list_namespaced_pod(name).items:  # no kubelet finishes their termination
        try:
            cluster.core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:  # the garbage collector may have removed it since the list
                raise
    cluster.core.delete_namespace(name)


def _children(c: Cluster, ns: str, name: str):
    def get(fn):
        try:
            return fn(name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
    return (get(c.apps.read_namespaced_deployment), get(c.core.read_namespaced_service),
            get(c.policy.read_namespaced_pod_disruption_budget))


def _cond(c: Cluster, ns: str, name: str, type_: str, status: str | None = None, reason: str | None = None,
          generation: int | None = None) -> dict | None:
    cond = c.condition(ns, name, type_)
    if cond is None or (status and cond["status"] != status) or (reason and cond.get("reason") != reason):
        return None
    if generation is not None and cond.get("observedGeneration") != generation:
        return None
    return cond


# -- install, admission ----------------------------------------------------------------------------------
def test_crd_installs_and_is_structural(cluster):
    crd = client.ApiextensionsV1Api(cluster.api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    conds = {c.type: c.status for c in crd.status.conditions}
    assert conds.get("Established") == "True" and conds.get("NonStructuralSchema") in (None, "False"), conds


@pytest.mark.parametrize("sample", sorted(p.name for p in (REPO / "crds/samples").glob("*.yaml")))
def test_every_sample_is_accepted_strictly(cluster, sample):
    body = yaml.safe_load((REPO / "crds/samples" / sample).read_text())
    cluster.namespace("e2e-samples")
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, "e2e-samples", PLURAL, body, dry_run="All",
                                                   field_validation="Strict")


INVALID = [  # (spec changes, what the API server must name)
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"dtype": "float64"}}, "spec.engine.dtype"),
    ({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 1}}, "spec"),
    ({"engine": {"speculative": {"method": "ngram"}}}, "spec.engine.speculative"),
    ({"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling"),
    ({"resources": {"gpus": 0, "memory": "lots"}}, "spec.resources.memory"),
    ({"modelCache": {"emptyDir": {"sizeLimit": "12 apples"}}}, "spec.modelCache.emptyDir.sizeLimit"),
    ({"engine": {"unknownField": 1}}, "unknownField"),  # fieldValidation=Strict
    ({"adapters": [{"name": "sql", "uri": "file:///a/sql"}, {"name": "sql", "uri": "file:///a/b"}]},
     "spec.adapters[1]"),  # a list map keyed by name: duplicate names
    ({"adapters": [{"name": "-sql", "uri": "file:///a/sql"}]}, "spec.adapters[0].name"),
]


@pytest.mark.parametrize("change,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_specs_are_refused_naming_the_field(cluster, change, field):
    cluster.namespace("e2e-samples")
    with pytest.raises(ApiException) as exc:
        cluster.create_isvc("e2e-samples", isvc("bad", **change))
    assert exc.value.status == 422 or (exc.value.status == 400 and field == "unknownField"), exc.value.body
    assert field in exc.value.body, exc.value.body


# -- the operator's life with a real API server ------------------------------------------------------------
def test_reconcile_wait_scale_and_garbage_collection(cluster, operator, ns):
    kubelet = Kubelet(cluster)
    cluster.create_isvc(ns, isvc("chat", replicas=2))  # 2 replicas: a PodDisruptionBudget too
    children = wait_for("the children", lambda: all(_children(cluster, ns, "chat")) and
                        _children(cluster, ns, "chat"), timeout=60)
    for child in children:
        owner = child.metadata.owner_references[0]
        assert owner.kind == "InferenceService" and owner.controller and owner.block_owner_deletion
    assert children[2].spec.unhealthy_pod_eviction_policy == "AlwaysAllow"
    # pods come from the real ReplicaSet controller; the test plays their kubelet
    wait_for("the pods", lambda: kubelet.pods(ns, SELECTOR.format("chat")), timeout=60)
    kubelet.make_ready(ns, SELECTOR.format("chat"))
    out = cluster.kubectl("wait", "-n", ns, "--for=condition=Ready", "--timeout=60s", "inferenceservice/chat",
                          check=False)
    assert out.returncode == 0, out.stderr
    # the scale subresource (what `kubectl scale` and HPA use) reaches the Deployment
    cluster.kubectl("scale", "-n", ns, "inferenceservice/chat", "--replicas=3")
    wait_for("3 replicas", lambda: cluster.apps.read_namespaced_deployment("chat", ns).spec.replicas == 3)
    # deletion: the controller-manager's garbage collector removes the children
    cluster.delete_isvc(ns, "chat")
    wait_for("children garbage-collected", lambda: not any(_children(cluster, ns, "chat")), timeout=90)
    assert operator.forbidden() == []


def test_ready_only_after_the_rollout(cluster, operator, ns):
    """After a spec change, no status carries Ready=True for the new generation before the new pods are
    ready (on a real API server the old code wrote it 0.1 s after the change, in 12 of 15 rollouts)."""
    kubelet = Kubelet(cluster)
    sel = SELECTOR.format("roll")
    cluster.create_isvc(ns, isvc("roll"))
    wait_for("pods", lambda: kubelet.pods(ns, sel), timeout=60)
    kubelet.make_ready(ns, sel)
    wait_for("Ready", lambda: _cond(cluster, ns, "roll", "Ready", "True"), timeout=60)
    for rollout in range(3):
        seen, stop = [], threading.Event()

        def record():
            w = watch.Watch()
            for ev in w.stream(cluster.custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                               timeout_seconds=60):
                seen.append((time.monotonic(), ev["object"]))
                if stop.is_set():
                    w.stop()

        t = threading.Thread(target=record, daemon=True)
        t.start()
        time.sleep(0.5)
        gen = cluster.patch_isvc(ns, "roll", {"spec": {"engine": {"maxNumSeqs": 8 + rollout}}})["metadata"]["generation"]
        time.sleep(3)  # the old code's early Ready came 0.1 s after the change
        dep = cluster.apps.read_namespaced_deployment("roll", ns)
        wait_for("the new ReplicaSet", lambda: _new_rs_hash(cluster, ns, "roll"), timeout=30)
        new_hash = _new_rs_hash(cluster, ns, "roll")
        wait_for("new pods", lambda: any(p.metadata.labels.get("pod-template-hash") == new_hash
                                         for p in kubelet.pods(ns, sel)), timeout=60)
        ready_at = time.monotonic()
        kubelet.make_ready(ns, sel, only=lambda p: p.metadata.labels.get("pod-template-hash") == new_hash)
        wait_for("Ready for the new generation", lambda: _cond(cluster, ns, "roll", "Ready", "True", generation=gen),
                 timeout=60)
        stop.set()
        cluster.patch_isvc(ns, "roll", {"metadata": {"annotations": {"e2e/poke": str(rollout)}}})  # end the watch
        t.join(70)
        early = [(round(ready_at - at, 2), o["status"]) for at, o in seen if at < ready_at
                 and (o.get("status") or {}).get("observedGeneration") == gen
                 and any(c["type"] == "Ready" and c["status"] == "True" and c.get("observedGeneration") == gen
                         for c in o["status"].get("conditions") or [])]
        assert not early, f"rollout {rollout}: Ready=True for generation {gen} before its pods were ready: {early}"
        assert dep is not None


def _new_rs_hash(c: Cluster, ns: str, name: str) -> str | None:
    dep = c.apps.read_namespaced_deployment(name, ns)
    if (dep.status.observed_generation or 0) < dep.metadata.generation:
        return None
    rss = [rs for rs in c.apps.list_namespaced_replica_set(ns).items
           if any(o.uid == dep.metadata.uid for o in rs.metadata.owner_references or [])]
    rev = dep.metadata.annotations.get("deployment.kubernetes.io/revision")
    for rs in rss:
        if rs.metadata.annotations.get("deployment.kubernetes.io/revision") == rev:
            return rs.metadata.labels.get("pod-template-hash")
    return None


def test_adapters_are_rendered_and_counted_per_ready_pod(cluster, operator, ns):
    """spec.adapters on a real API server: accepted strictly, rendered as --lora-modules, and
    status.adapters counts the ready pods started with each (the kubelet is played)."""
    kubelet = Kubelet(cluster)
    sel = SELECTOR.format("lora")
    adapters = [{"name": "sql", "uri": "file:///adapters/sql"}, {"name": "chat", "uri": "file:///adapters/chat"}]
    cluster.create_isvc(ns, isvc("lora", adapters=adapters))
    wait_for("pods", lambda: kubelet.pods(ns, sel), timeout=60)
    args = cluster.apps.read_namespaced_deployment("lora", ns).spec.template.spec.containers[0].args
    assert args[args.index("--lora-modules") + 1:][:2] == ["sql=/adapters/sql", "chat=/adapters/chat"]
    kubelet.make_ready(ns, sel)
    want = [{"name": "sql", "readyReplicas": 1}, {"name": "chat", "readyReplicas": 1}]
    wait_for("status.adapters", lambda: (cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, "lora").get("status") or {}).get("adapters") == want, timeout=60)
    assert operator.forbidden() == []


def test_quota_refusal_is_degraded(cluster, operator, ns):
    """A ReplicaSet that cannot create pods (ResourceQuota) makes the InferenceService Degraded/FailedCreate
    with the quota's message within seconds, not after the progress deadline."""
    cluster.core.create_namespaced_resource_quota(ns, client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="gpu-quota"), spec=client.V1ResourceQuotaSpec(hard={"pods": "0"})))
    t0 = time.monotonic()
    cluster.create_isvc(ns, isvc("quota"))
    cond = wait_for("Degraded/FailedCreate", lambda: _cond(cluster, ns, "quota", "Degraded", "True", "FailedCreate"),
                    timeout=60)
    assert "exceeded quota" in cond["message"] and "gpu-quota" in cond["message"], cond
    print(f"\nquota: Degraded/FailedCreate {time.monotonic() - t0:.1f} s after create")


def test_affinity_typo_is_refused_not_rendered(cluster, operator, ns):
    """The API server would drop `nodeAffinty` with only a warning; the operator refuses it, naming the
    path, and creates no Deployment (and so never re-patches one)."""
    body = isvc("typo", scheduling={"affinity": {"nodeAffinty": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}})
    cluster.create_isvc(ns, body)
    cond = wait_for("Degraded", lambda: _cond(cluster, ns, "typo", "Degraded", "True"), timeout=60)
    assert "spec.scheduling.affinity.nodeAffinty" in cond["message"], cond
    time.sleep(3)
    assert _children(cluster, ns, "typo")[0] is None


def test_crash_loop_is_degraded(cluster, operator, ns):
    kubelet = Kubelet(cluster)
    cluster.create_isvc(ns, isvc("crash"))
    wait_for("pods", lambda: kubelet.pods(ns, SELECTOR.format("crash")), timeout=60)
    kubelet.crash_loop(ns, SELECTOR.format("crash"))
    cond = wait_for("Degraded/CrashLoopBackOff", lambda: _cond(cluster, ns, "crash", "Degraded", "True",
                                                                "CrashLoopBackOff"), timeout=60)
    assert cond["message"]


def test_pod_patch_policy_allows_only_the_deletion_cost(cluster, operator, ns):
    """The chart's ValidatingAdmissionPolicy on a real API server: with the operator's own token, the
    pod-deletion-cost annotation can be set; a label or another annotation cannot."""
    kubelet = Kubelet(cluster)
    cluster.create_isvc(ns, isvc("vap"))
    pod = wait_for("a pod", lambda: kubelet.pods(ns, SELECTOR.format("vap")), timeout=60)[0].metadata.name
    as_operator = client.CoreV1Api(Cluster(str(operator.kubeconfig)).api)
    as_operator.patch_namespaced_pod(pod, ns, {"metadata": {"annotations": {
        "controller.kubernetes.io/pod-deletion-cost": "-5"}}})
    for patch in ({"metadata": {"labels": {"evil": "1"}}}, {"metadata": {"annotations": {"other": "x"}}}):
        with pytest.raises(ApiException) as exc:
            as_operator.patch_namespaced_pod(pod, ns, patch)
        assert exc.value.status == 403 and "kvfleet-pod-patch" in exc.value.body, exc.value.body


def test_no_request_of_the_operator_was_forbidden(cluster, operator):
    """Runs last in this module: everything above used only the chart's RBAC."""
    assert operator.forbidden() == []


# -- scale mode -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.environ.get("KVFLEET_E2E_SCALE"), reason="scale mode: set KVFLEET_E2E_SCALE=N")
def test_scale(cluster, operator):
    """N InferenceServices: time to all children and to all current statuses, the operator's CPU seconds
    until then (less sensitive than wall time to what else runs on a shared host), operator RSS before, at peak
    and after deletion, operator writes in a minute at rest, and Services refused by an admission policy
    for some objects showing Degraded on exactly those."""
    n = int(os.environ["KVFLEET_E2E_SCALE"])
    ns = cluster.namespace("e2e-scale")
    adm = client.AdmissionregistrationV1Api(cluster.api)
    refused = {f"s{i}" for i in range(0, n, 97)}  # every 97th object's Service is refused
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": "e2e-refuse-services"},
              "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": [{
                  "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["services"]}]},
                  "validations": [{"expression": f"!(object.metadata.name in {sorted(refused)!r})".replace("'", '"'),
                                   "message": "e2e: this Service is refused by an admission policy"}]}}
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": "e2e-refuse-services"},
               "spec": {"policyName": "e2e-refuse-services", "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": ns}}}}}
    for body, fn in ((policy, adm.create_validating_admission_policy),
                     (binding, adm.create_validating_admission_policy_binding)):
        try:
            fn(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
    time.sleep(2)
    rss0, cpu0 = operator.rss_mb(), operator.cpu_s()
    deployments = Progress(cluster, ns, "apps", "v1", "deployments", lambda o: True)
    statuses = Progress(cluster, ns, GROUP, VERSION, PLURAL,
                        lambda o: (o.get("status") or {}).get("observedGeneration") == 1)
    api0, op0 = apiserver_requests(cluster), operator_requests(operator.metrics_port)
    # created the way a platform team does (kubectl, a Go client: one POST per object, in order), not by
    # this process's Python client, which costs ~3 ms of CPU a create on the cores the system under test
    # shares and holds the GIL against the two watches timing it; --validate=false: no client-side schema
    # fetch (fieldValidation=Ignore: the objects have no unknown field; the CRD's schema and rules still run)
    items = {"apiVersion": "v1", "kind": "List", "items": [isvc(f"s{i}") for i in range(n)]}
    t0 = time.monotonic()
    out = cluster.kubectl("create", "--validate=false", "-n", ns, "-f", "-", "-o", "name", input=json.dumps(items),
                          timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    created = time.monotonic() - t0
    t_children = deployments.wait(f"{n} Deployments", n, timeout=600) - t0
    t_status = statuses.wait(f"{n} statuses", n, timeout=600) - t0
    deployments.stop()
    statuses.stop()
    api1, op1 = apiserver_requests(cluster), operator_requests(operator.metrics_port)
    rss_peak, cpu = operator.rss_mb(), operator.cpu_s() - cpu0
    items = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
    degraded = {o["metadata"]["name"] for o in items
                if any(c["type"] == "Degraded" and c["status"] == "True" for c in o["status"].get("conditions", []))}
    # at rest: once the controller-manager has settled (no Deployment changed in 15 s: it is still writing
    # ReplicaSets, pods and Deployment status long after the statuses are current), no operator write in a
    # minute: the InferenceServices' resourceVersions (status and spec) and the Deployments' generations (a
    # spec write by the operator; the controller-manager's status writes do not count) are unchanged
    def deployment_versions():
        return {d.metadata.name: d.metadata.resource_version for d in cluster.apps.list_namespaced_deployment(ns).items}
    last = {"v": deployment_versions()}

    def settled():
        now = deployment_versions()
        same, last["v"] = now == last["v"], now
        return same
    wait_for("the controller-manager to settle", settled, timeout=600, interval=15)
    t_settled = time.monotonic() - t0

    def versions():
        return ({o["metadata"]["name"]: o["metadata"]["resourceVersion"]
                 for o in cluster.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]},
                {d.metadata.name: d.metadata.generation for d in cluster.apps.list_namespaced_deployment(ns).items})
    before = versions()
    time.sleep(60)
    after = versions()
    writes = sum(before[i][k] != after[i].get(k) for i in (0, 1) for k in before[i])
    for i in range(n):
        cluster.delete_isvc(ns, f"s{i}")
    wait_for("deletion", lambda: not cluster.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"],
             timeout=600, interval=2)
    time.sleep(30)
    rss_after = operator.rss_mb()
    adm.delete_validating_admission_policy_binding("e2e-refuse-services")
    adm.delete_validating_admission_policy("e2e-refuse-services")
    print(f"\nscale {n}: created in {created:.1f} s; all children {t_children:.1f} s; all statuses {t_status:.1f} s; "
          f"controller-manager settled {t_settled:.1f} s; operator CPU until all statuses {cpu:.1f} s; "
          f"operator RSS {rss0:.0f} -> {rss_peak:.0f} -> {rss_after:.0f} MB after deletion; writes in 60 s at rest: "
          f"{writes}; Degraded: {len(degraded)} (refused Services: {len(refused)})\n"
          f"requests until all statuses: operator {counts_delta(op0, op1)}\n"
          f"  API server, all clients: {counts_delta(api0, api1)}")
    assert degraded == refused, sorted(degraded ^ refused)[:20]
    assert writes == 0
    assert t_children <= 60 and t_status <= 60
    assert rss_peak <= 200 and rss_after < rss_peak
