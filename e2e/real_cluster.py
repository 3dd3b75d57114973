"""Helpers of the real-cluster suite (e2e/test_real_cluster.py): the cluster from a kubeconfig, the chart
installed with helm, the operator running under the chart's ServiceAccount token, and a stand-in kubelet.

Any real cluster works (kind, a cloud cluster, a bare kube-apiserver + kube-controller-manager). A
cluster without kubelets (no nodes) keeps pods Pending: ``Kubelet`` then plays the kubelet by writing
``pods/status`` (phase, the Ready condition, containerStatuses), which is all the ReplicaSet and
Deployment controllers read.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[1]
GROUP, VERSION, PLURAL = "serving.kvfleet.dev", "v1alpha1", "inferenceservices"
OPERATOR_NS, RELEASE = "kvfleet-system", "kvfleet"
ENV = "KVFLEET_E2E_KUBECONFIG"


def skip_reason() -> str | None:
    """Why the suite cannot run, or None."""
    path = os.environ.get(ENV)
    if not path:
        return (f"no real cluster: set {ENV} to a kubeconfig (kind, any cluster, or a local kube-apiserver + "
                "kube-controller-manager) to run it")
    if not Path(path).is_file():
        return f"{ENV}={path} is not a file"
    return None


def tool(name: str) -> str:
    """helm / kubectl: from PATH, else from the PyPI package (tests/chart/k8s_tools.py)."""
    out = subprocess.run([sys.executable, str(REPO / "tests/chart/k8s_tools.py"), name],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.25) -> Any:
    """Poll ``fn`` until it returns something truthy; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The admin view of the cluster: typed clients plus the kubeconfig they came from."""

    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.policy = client.PolicyV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        # --validate=false only matters for `apply`/`create`: no client-side OpenAPI fetch, and kubectl asks
        # the API server to ignore unknown fields (fieldValidation=Ignore; the CRD's schema and rules still run)
        return subprocess.run([tool("kubectl"), "--kubeconfig", self.kubeconfig, *args], capture_output=True,
                              text=True, check=check, input=input, timeout=timeout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([tool("helm"), "--kubeconfig", self.kubeconfig, *args], capture_output=True,
                             text=True, timeout=300)
        if check and out.returncode:
            raise AssertionError(f"helm {' '.join(args)}: {out.stderr}")
        return out

    # -- InferenceServices -------------------------------------------------------------------------
    def create_isvc(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body, field_validation="Strict")

    def get_isvc(self, ns: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)

    def patch_isvc(self, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, patch)

    def delete_isvc(self, ns: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def condition(self, ns: str, name: str, type_: str) -> dict[str, Any] | None:
        st = self.get_isvc(ns, name).get("status") or {}
        return next((c for c in st.get("conditions") or [] if c.get("type") == type_), None)

    def namespace(self, name: str) -> str:
        try:
            self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        except ApiException as exc:
            if exc.status != 409:
                raise
        return name


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    """A small CPU InferenceService (no GPU requested), ``spec`` merged over it."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"uri": "bundled://smollm2", "name": "smollm2"},
                     "engine": {"image": "kvfleet-server:cpu", "dtype": "float32", "maxModelLen": 2048},
                     "replicas": 1, "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}}}
    for k, v in spec.items():
        body["spec"][k] = {**body["spec"].get(k, {}), **v} if isinstance(v, dict) else v
    return body


class Progress:
    """When each object of one resource in a namespace first met ``done``: one watch, opened before the
    burst it measures. A harness that lists 1,000 objects every 2 s instead makes the API server it measures
    serve (and the operator's host share) several MB of JSON a poll."""

    def __init__(self, cluster: Cluster, ns: str, group: str, version: str, plural: str,
                 done: Callable[[dict[str, Any]], bool]):
        self.at: dict[str, float] = {}
        self._w, self._stopped = watch.Watch(), False
        args = (cluster.custom.list_namespaced_custom_object, group, version, ns, plural)
        self._thread = threading.Thread(target=self._run, args=(args, done), daemon=True)
        self._thread.start()

    def _run(self, args: tuple, done: Callable[[dict[str, Any]], bool]) -> None:
        while not self._stopped:
            try:
                for ev in self._w.stream(*args):
                    obj = ev["object"]
                    name = obj["metadata"]["name"]
                    if ev["type"] != "DELETED" and name not in self.at and done(obj):
                        self.at[name] = time.monotonic()
            except Exception:  # e.g. 504 "Too large resource version" while the watch cache catches up, a
                # connection the API server closed: a fresh watch lists the current state again
                self._w = watch.Watch()
                time.sleep(0.5)

    def wait(self, what: str, n: int, timeout: float) -> float:
        """The monotonic time the ``n``-th object met ``done``."""
        wait_for(what, lambda: len(self.at) >= n, timeout=timeout, interval=0.5)
        return max(self.at.values())

    def stop(self) -> None:
        self._stopped = True
        self._w.stop()


def operator_requests(metrics_port: int) -> dict[str, float]:
    """The operator's API requests by ``verb resource`` (its kvfleet_operator_api_requests_total)."""
    import httpx
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return _counts(text, "kvfleet_operator_api_requests", ("verb", "resource"))


def apiserver_requests(cluster: Cluster) -> dict[str, float]:
    """Every client's requests to the API server by ``verb resource`` (its apiserver_request_total)."""
    return _counts(cluster.kubectl("get", "--raw", "/metrics").stdout, "apiserver_request", ("verb", "resource"))


def _counts(text: str, family: str, keys: tuple[str, ...]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    k = " ".join(s.labels.get(x, "") for x in keys)
                    out[k] = out.get(k, 0) + s.value
    return out


def counts_delta(before: dict[str, float], after: dict[str, float], top: int = 12) -> str:
    """The largest increases, as ``verb resource: n`` pairs."""
    d = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    return ", ".join(f"{k}: {v:.0f}" for v, k in d[:top] if v > 0)


class Kubelet:
    """Plays the kubelet for a cluster without nodes: marks the pods of a selector Running and Ready (or
    crash-looping), the way a kubelet writes ``pods/status``."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def pods(self, ns: str, selector: str) -> list[client.V1Pod]:
        return [p for p in self.c.core.list_namespaced_pod(ns, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]

    def _status(self, pod: client.V1Pod, ready: bool, waiting: str | None = None) -> dict[str, Any]:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        statuses = []
        for c in pod.spec.containers:
            st: dict[str, Any] = {"name": c.name, "image": c.image, "imageID": f"docker://{c.image}",
                                  "ready": ready, "started": ready, "restartCount": 3 if waiting else 0}
            st["state"] = ({"waiting": {"reason": waiting, "message": "back-off restarting failed container"}}
                           if waiting else {"running": {"startedAt": now}})
            statuses.append(st)
        cond = "True" if ready else "False"
        return {"status": {"phase": "Running", "podIP": "10.0.0.1", "hostIP": "10.0.0.2", "startTime": now,
                           "conditions": [{"type": t, "status": cond if t in ("Ready", "ContainersReady") else "True",
                                           "lastTransitionTime": now}
                                          for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                           "containerStatuses": statuses}}

    def make_ready(self, ns: str, selector: str, only: Callable[[client.V1Pod], bool] = lambda p: True) -> int:
        n = 0
        for pod in self.pods(ns, selector):
            if only(pod) and not _is_ready(pod):
                self.c.core.patch_namespaced_pod_status(pod.metadata.name, ns, self._status(pod, True))
                n += 1
        return n

    def crash_loop(self, ns: str, selector: str) -> int:
        pods = self.pods(ns, selector)
        for pod in pods:
            self.c.core.patch_namespaced_pod_status(pod.metadata.name, ns, self._status(pod, False, "CrashLoopBackOff"))
        return len(pods)


def _is_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def install(cluster: Cluster, values: dict[str, Any] | None = None) -> None:
    """The CRDs (server-side apply: the API server checks the structural schema) and the chart."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{PLURAL}.{GROUP}")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(values or {}, f)
    chart = (RELEASE, str(REPO / "charts/kvfleet"), "-n", OPERATOR_NS, "-f", f.name, "--skip-crds")
    out = cluster.helm("upgrade", "--install", *chart, "--create-namespace", check=False)
    if out.returncode and "failed to download openapi" in out.stderr:
        # helm validates against the server's OpenAPI document, which some API-server builds serve
        # malformed (a bare kube-apiserver built from OpenShift's fork): apply the same manifests with
        # the server's own validation (fieldValidation=Strict) instead
        cluster.namespace(OPERATOR_NS)
        apply_strict(cluster, cluster.helm("template", *chart).stdout, OPERATOR_NS)
    elif out.returncode:
        raise AssertionError(f"helm install: {out.stderr}")


def apply_strict(cluster: Cluster, manifests: str, namespace: str) -> None:
    """Server-side apply of every document of ``manifests`` with fieldValidation=Strict (the REST API's
    own validation: an unknown or duplicate field is an error)."""
    from kubernetes.dynamic import DynamicClient
    dyn = DynamicClient(cluster.api)
    for obj in yaml.safe_load_all(manifests):
        if not obj:
            continue
        res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        ns = (obj["metadata"].get("namespace") or namespace) if res.namespaced else None
        req = cluster.api.param_serialize(
            "PATCH", res.path(name=obj["metadata"]["name"], namespace=ns),
            query_params=[("fieldManager", "kvfleet-e2e"), ("force", "true"), ("fieldValidation", "Strict")],
            header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
            body=json.dumps(obj), auth_settings=["BearerToken"])
        resp = cluster.api.call_api(*req)
        if resp.status >= 300:
            raise AssertionError(f"apply {obj['kind']}/{obj['metadata']['name']}: {resp.status} {resp.read()[:2000]}")


class Operator:
    """The operator as the chart deploys it (its Deployment's args and env), run here as a process with
    the chart ServiceAccount's token: every API call it makes is authorised by the chart's RBAC alone."""

    def __init__(self, cluster: Cluster, workdir: Path, extra_env: dict[str, str] | None = None):
        self.c = cluster
        dep = cluster.apps.read_namespaced_deployment(RELEASE, OPERATOR_NS)
        ctr = dep.spec.template.spec.containers[0]
        sa = dep.spec.template.spec.service_account_name
        token = cluster.kubectl("create", "token", sa, "-n", OPERATOR_NS, "--duration=4h").stdout.strip()
        admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
        ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        cl = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])["cluster"]
        kc = {"apiVersion": "v1", "kind": "Config", "current-context": "operator",
              "clusters": [{"name": "c", "cluster": cl}],
              "users": [{"name": "sa", "user": {"token": token}}],
              "contexts": [{"name": "operator", "context": {"cluster": "c", "user": "sa"}}]}
        self.kubeconfig = workdir / "operator.kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(kc))
        self.health_port, self.metrics_port = free_port(), free_port()
        args = []
        skip = False
        for a in ctr.args or []:  # the chart's args, with the liveness/metrics ports made local
            if skip:
                skip = False
                continue
            if a in ("--liveness", "--metrics-port"):
                skip = True
                continue
            if a.startswith(("--liveness=", "--metrics-port=")):
                continue
            args.append(a)
        args += ["--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
                 "--metrics-port", str(self.metrics_port)]
        env = {e.name: e.value for e in ctr.env or [] if e.value is not None}
        env.setdefault("POD_ID", "e2e-operator")
        self.log_path = workdir / "operator.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_operator", *args],
            env={**os.environ, **env, **(extra_env or {}), "KUBECONFIG": str(self.kubeconfig),
                 "PYTHONUNBUFFERED": "1"},
            stdout=self.log, stderr=subprocess.STDOUT)
        self.args = args

    def forbidden(self) -> list[str]:
        """Lines of the operator's log where RBAC refused it ("... cannot VERB resource ..."; not the other
        403s, e.g. a create in a namespace being terminated)."""
        return [ln for ln in self.log_path.read_text().splitlines()
                if ("403" in ln or "Forbidden" in ln) and " cannot " in ln and "resource" in ln]

    def rss_mb(self) -> float:
        for ln in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds the operator process has used (user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:3000]
