"""The chart's RBAC enforced on the real operator (kopf runtime + handlers + autoscaler).

A KMock API-server emulator (the operator tests' ``ApiServerEmulator``) is extended to authorize
every request carrying the operator's token against the rules the chart renders for its
ServiceAccount, answering 403 Forbidden otherwise — what a real API server does. The operator
runs with the arguments of the rendered Deployment (all namespaces, peering) and goes through its
life cycle: startup and peering, a model reconciled with autoscaling on, an unrealisable spec
(Degraded, kopf's warning Event), a deleted child recreated.
Nothing may be denied. This complements the static analysis of test_rbac.py: it also sees what
kopf does inside (discovery, watches, peering keep-alives, event posting).

Limits (KMock's): cluster-wide mode only (KMock cannot serve the namespace listing kopf issues
in namespaced mode); no deletion flow (KMock deletes at once, without finalizers) — releasing
kopf's finalizer is a patch of the InferenceService, exercised throughout anyway.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import kmock
import kopf
import pytest
import yaml
from kopf.testing import KopfRunner

from . import rbac_analysis as ra
from .conftest import render_chart

REPO = Path(__file__).resolve().parents[2]
OPERATOR_TOKEN = "operator-sa-token"
ADMIN_TOKEN = "admin-token"
PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


support = _load("kvfleet_chart_kmock_support", REPO / "tests/operator/kmock_support.py")
isvc_api = pytest.importorskip("kvfleet_operator.api")
cli = pytest.importorskip("kvfleet_operator.cli")
kube = pytest.importorskip("kvfleet_operator.kube")
AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL


def verb_of(request) -> str:
    """The RBAC verb of an HTTP request (Kubernetes' request-info rules)."""
    method = request.method.value
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if request.name else "deletecollection"}.get(method, method.lower())


class RbacEmulator(support.ApiServerEmulator):
    """The emulator, authorizing the operator's requests with rendered RBAC (403 otherwise)."""

    grants: ra.Grants | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.denied: list[str] = []
        self.allowed: set[tuple[str, str, str]] = set()

    async def _handle(self, request):
        auth = request.headers.get("Authorization", "")
        # Discovery (/api/v1, /apis/GROUP/VERSION: no plural) is open to every authenticated
        # client (ClusterRole system:discovery); resource requests are authorized.
        if request.resource is not None and request.resource.plural and auth == f"Bearer {OPERATOR_TOKEN}":
            group = request.resource.group or ""
            plural = request.resource.plural
            resource = f"{plural}/{request.subresource}" if request.subresource else plural
            verb = verb_of(request)
            scope = "cluster" if request.namespace is None else "namespace"
            req = ra.Requirement(group, resource, verb, scope)
            namespaces = None if request.namespace is None else [request.namespace]
            if not self.grants.allows(req, namespaces):
                where = request.namespace or "cluster"
                self.denied.append(f"{verb} {group or 'core'}/{resource} in {where}")
                raise kmock.KubernetesError(status=403, reason="Forbidden",
                                            message=f"RBAC: {verb} {resource} denied by the chart's rules")
            self.allowed.add((group, resource, verb))
        return await super()._handle(request)


def _kopf_args(manifests) -> list[str]:
    """`kopf run` arguments equivalent to the rendered `kvfleet-operator run` arguments."""
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    args = cli.build_parser().parse_args(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert not args.namespace, "KMock serves cluster-wide mode only"
    out = ["run", "-A", "--verbose"]
    out += ["--standalone"] if args.standalone else ["--peering", args.peering]
    for module in cli.operator_modules():
        out += ["-m", module]
    return out


def _grants(manifests) -> ra.Grants:
    dep = next(m for m in manifests if m["kind"] == "Deployment")
    return ra.grants_for(manifests, dep["spec"]["template"]["spec"]["serviceAccountName"],
                         dep["metadata"]["namespace"])


@pytest.fixture()
async def cluster(tmp_path, monkeypatch):
    emu = RbacEmulator()
    support.register_resources(emu)
    emu.resources[PEERINGS] = kmock.ResourceInfo(
        kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False,
        verbs={"list", "watch", "get", "patch", "create"})
    async with emu, kmock.Server(emu):
        cfg = json.loads(support.write_kubeconfig(tmp_path / "kubeconfig", str(emu.url)).read_text())
        cfg["users"][0]["user"]["token"] = OPERATOR_TOKEN
        (tmp_path / "kubeconfig").write_text(json.dumps(cfg))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        kube.set_credentials(None)
        admin = kube.KubeClient(kopf.ConnectionInfo(server=str(emu.url).rstrip("/"), token=ADMIN_TOKEN))
        try:
            yield emu, admin
        finally:
            await admin.close()


async def _operator(manifests):
    runner = KopfRunner(_kopf_args(manifests), timeout=30, settings=support.fast_settings())
    await asyncio.to_thread(runner.__enter__)
    return runner


def _sample(name: str, **spec) -> dict:
    obj = yaml.safe_load((REPO / "crds/samples/smollm2-135m-cpu.yaml").read_text())
    obj["metadata"] = {"name": name, "namespace": "default", "resourceVersion": "1"}
    obj["spec"].update(spec)
    return obj


def _cond(obj, type_):
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def test_operator_life_cycle_under_the_charts_rbac(helm, cluster):
    emu, admin = cluster
    manifests = render_chart(helm)  # default values: all namespaces, peering
    emu.grants = _grants(manifests)
    runner = await _operator(manifests)
    try:
        await support.wait_for(lambda: admin.get("kopf.dev/v1", "clusterkopfpeerings", None, "kvfleet"))
        await admin.create(AV, PL, "default", _sample(
            "live", autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2, "metricsIntervalSeconds": 1}))
        dep = await support.wait_for(lambda: admin.get("apps/v1", "deployments", "default", "live"))
        await support.wait_for(lambda: admin.get("v1", "services", "default", "live"))

        async def reported():
            obj = await admin.get(AV, PL, "default", "live")
            return obj if (obj.get("status") or {}).get("url") else None
        await support.wait_for(reported)
        # The autoscaler's daemon ran a tick: it read the Deployment and listed the pods.
        await support.wait_for(lambda: ("", "pods", "list") in emu.allowed or emu.denied)

        await admin.create(AV, PL, "default", _sample("broken", model={"uri": "ftp://models/x"}))

        async def degraded():
            return _cond(await admin.get(AV, PL, "default", "broken"), "Degraded").get("status") == "True"
        await support.wait_for(degraded)

        await admin.delete("apps/v1", "deployments", "default", "live")

        async def recreated():
            new = await admin.get("apps/v1", "deployments", "default", "live")
            return new if new and new["metadata"]["uid"] != dep["metadata"]["uid"] else None
        await support.wait_for(recreated)

    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)

    assert emu.denied == [], "operator requests the chart's RBAC refuses:\n" + "\n".join(emu.denied)
    # The enforcement saw the operator at work (kopf internals, reconcile, autoscaler). Events are
    # posted only when the autoscaler changes the replicas (not in this scenario; see test_rbac.py).
    for seen in [("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                 ("kopf.dev", "clusterkopfpeerings", "patch"),
                 ("serving.kvfleet.dev", "inferenceservices", "watch"),
                 ("serving.kvfleet.dev", "inferenceservices/status", "patch"),
                 ("apps", "deployments", "create"), ("", "services", "create"),
                 ("", "pods", "list")]:
        assert seen in emu.allowed, f"expected the operator to {seen[2]} {seen[1]}"


async def test_a_missing_rule_is_refused_and_noticed(helm, cluster):
    """The same enforcement denies what the chart does not grant (here: creating Deployments)."""
    emu, admin = cluster
    manifests = render_chart(helm)
    for m in manifests:
        if m["kind"] == "ClusterRole":
            for rule in m["rules"]:
                if rule["resources"] == ["deployments"]:
                    rule["verbs"].remove("create")
    emu.grants = _grants(manifests)
    runner = await _operator(manifests)
    try:
        await admin.create(AV, PL, "default", _sample("live"))
        await support.wait_for(lambda: "create apps/deployments in default" in emu.denied)
        assert await admin.get("apps/v1", "deployments", "default", "live") is None
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
