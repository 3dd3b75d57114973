"""Pure rendering: an InferenceService object (dict) -> its Deployment, Service and PodDisruptionBudget.

No I/O. ``render(obj, replicas=...)`` returns plain dicts ready for the API; ``parse_spec`` validates
the spec with the api models (defaults filled in); ``Unrealisable`` is raised for specs that pass the
schema but cannot be run (the reconcile reports them as Degraded and does not retry).

Choices (see docs/operator.md): the server container runs the runtime's server (``kvfleet-server``, or
``vllm serve`` for ``engine.runtime: vllm``: runtime.py) with every engine field as its vLLM-style flag;
the startup probe allows ``probes.startupTimeoutSeconds`` exactly
(periodSeconds x failureThreshold); terminationGracePeriodSeconds = preStop sleep + drain timeout +
margin; rolling updates use maxSurge 0 / maxUnavailable 1 because a surge pod that cannot get a GPU
deadlocks a full cluster; GPU pods request CPU and memory per GPU (``ServingDefaults``) and
tensor-parallel pods get a memory-backed /dev/shm with a size limit, counted in the memory request;
replicas spread across nodes (ScheduleAnyway); the PDB lets unhealthy pods be evicted (a
crash-looping pod never blocks a node drain); pods run as non-root with a read-only root filesystem.
Every child is checked against the strict Kubernetes schema (``strict``) before it is returned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Mapping

import pydantic

from . import api, cache, routing, runtime, strict
from .apply import quantity
from .model_source import Pin
from .server_args import container_args, server_args
from .unrealisable import Unrealisable

MANAGED_BY = "kvfleet-operator"
SERVER_CONTAINER = "kvfleet-server"  # the server container's name, whatever the runtime (tools find it by name)
HTTP_PORT_NAME = "http"
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 10
STARTUP_MAX_PERIOD_SECONDS = 10
RUN_AS_USER = 1000
INSTANCE_LABEL = "app.kubernetes.io/instance"
NAME_LABEL = "app.kubernetes.io/name"
OWNER_LABEL = "serving.kvfleet.dev/inferenceservice"
#: on the pod template: the LoRA adapters its server is started with (status.adapters counts ready pods by it)
ADAPTERS_ANNOTATION = "serving.kvfleet.dev/lora-adapters"


@dataclass(frozen=True)
class ServingDefaults:
    """What an InferenceService leaves to the operator (the chart's servingImage, vllmImage and
    servingDefaults, given to the operator as the environment variables of ``ENV``; ``from_env`` reads
    them once at start-up): the serving image and its pull policy; the image of runtime vllm (same pull
    policy); per GPU of a GPU replica, the CPU request, the memory request and the size of the
    memory-backed /dev/shm of tensor-parallel pods (Kubernetes quantities).

    Sizing per GPU, as the peers do (KubeAI's L4/L40S profiles request 6 CPUs and 24Gi per GPU,
    AMD's AIM engine 4 CPUs per GPU; KServe's LLM templates size /dev/shm at 1Gi for one node):
    4 CPUs feed one GPU's tokenization, detokenization, scheduling and HTTP; 24Gi holds a CUDA context
    and the host-side buffers of loading a 24 GB GPU's share of weights; 1Gi of /dev/shm per
    tensor-parallel rank covers NCCL's shared-memory buffers (4 MiB per channel and peer)."""
    image: str = api.DEFAULT_IMAGE
    pull_policy: str = api.DEFAULT_PULL_POLICY
    vllm_image: str = runtime.DEFAULT_VLLM_IMAGE
    cpu_per_gpu: str = "4"
    memory_per_gpu: str = "24Gi"
    shm_per_gpu: str = "1Gi"

    ENV = {"image": "KVFLEET_SERVING_IMAGE", "pull_policy": "KVFLEET_SERVING_IMAGE_PULL_POLICY",
           "vllm_image": "KVFLEET_VLLM_IMAGE", "cpu_per_gpu": "KVFLEET_CPU_PER_GPU",
           "memory_per_gpu": "KVFLEET_MEMORY_PER_GPU", "shm_per_gpu": "KVFLEET_SHM_PER_GPU"}

    def __post_init__(self) -> None:
        for name in ("cpu_per_gpu", "memory_per_gpu", "shm_per_gpu"):
            value = getattr(self, name)
            if quantity(value) is None or quantity(value) <= 0:
                raise ValueError(f"{self.ENV[name]}: {value!r} is not a positive Kubernetes quantity")

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "ServingDefaults":
        """The defaults with each variable of ``ENV`` that is set and not empty; ValueError names a
        variable whose value is not a positive quantity."""
        return cls(**{name: env[var] for name, var in cls.ENV.items() if env.get(var)})

    def image_for(self, name: str) -> str:
        """The default image of runtime ``name``."""
        return self.vllm_image if name == runtime.VLLM else self.image


def parse_spec(obj: dict[str, Any]) -> api.InferenceServiceSpec:
    """Validate ``obj['spec']`` with the api models; raises Unrealisable(reason='InvalidSpec')."""
    try:
        return api.InferenceServiceSpec.model_validate(obj.get("spec") or {})
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = strict.field_path(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")  # the api validators' messages name the field
            problems.append(f"spec.{loc}: {msg}" if loc and not msg.startswith("spec.") else msg)
        raise Unrealisable("InvalidSpec", "; ".join(problems)) from None


# ------------------------------------------------------------------------------------ labels etc.
def selector_labels(name: str) -> dict[str, str]:
    """Labels that select an InferenceService's pods (immutable Deployment selector)."""
    return {NAME_LABEL: "kvfleet-server", INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """status.selector: the pod selector as a string (for the scale subresource and HPA-style tools)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def common_labels(name: str) -> dict[str, str]:
    """app.kubernetes.io labels carried by every child and by the pods."""
    return {**selector_labels(name), "app.kubernetes.io/component": "inference-server",
            "app.kubernetes.io/part-of": "kvfleet", "app.kubernetes.io/managed-by": MANAGED_BY,
            OWNER_LABEL: name}


def service_url(name: str, namespace: str, port: int) -> str:
    """OpenAI base URL of the Service inside the cluster."""
    return f"http://{name}.{namespace}.svc:{port}/v1"


def owner_reference(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The controller ownerReference to the InferenceService (None when it has no uid yet)."""
    meta = obj.get("metadata", {})
    if not meta.get("uid"):
        return None
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def startup_probe_timing(timeout_seconds: int) -> tuple[int, int]:
    """(periodSeconds, failureThreshold) with period x threshold == timeout_seconds exactly.

    The period is the largest divisor of the timeout not above 10 s (1 s at worst)."""
    period = next(p for p in range(min(STARTUP_MAX_PERIOD_SECONDS, timeout_seconds), 0, -1)
                  if timeout_seconds % p == 0)
    return period, timeout_seconds // period


def termination_grace_seconds(spec: api.InferenceServiceSpec) -> int:
    """preStop sleep + server drain timeout + a margin, so the drain is never cut short by SIGKILL."""
    return PRESTOP_SLEEP_SECONDS + spec.engine.shutdown_timeout_seconds + TERMINATION_MARGIN_SECONDS


def desired_replicas(spec: api.InferenceServiceSpec, live_replicas: int | None,
                     status_desired: int | None) -> int:
    """Replicas the Deployment should get.

    Autoscaling disabled: spec.replicas. Enabled: the autoscaler owns the count — keep the live
    Deployment's replicas (else status.desiredReplicas, else minReplicas), clamped to [min, max]."""
    auto = spec.autoscaling
    if not auto.enabled:
        return spec.replicas
    current = live_replicas if live_replicas is not None else status_desired
    current = auto.min_replicas if current is None else current
    return max(auto.min_replicas, min(auto.max_replicas or auto.min_replicas, current))


def with_replicas(children: "Children", replicas: int) -> "Children":
    """A copy of ``children`` (a ``render(obj)`` result) with the Deployment scaled to ``replicas``.

    Equal to ``render(obj, replicas)`` for every count ``desired_replicas`` returns: only the Deployment's
    replicas depend on the live count (the PDB follows maxReplicas with autoscaling; without it,
    ``desired_replicas`` is spec.replicas whatever the live count). So a reconcile renders once, before
    it reads the live children, and scales after."""
    dep = children.deployment
    return replace(children, deployment={**dep, "spec": {**dep["spec"], "replicas": replicas}})


def format_quantity(value: Decimal, binary: bool) -> str:
    """A quantity as Kubernetes prints it: memory (``binary``) with the largest exact binary suffix
    (Ki ... Ei), else in bytes rounded up; CPUs in cores when whole, else in millicores rounded up."""
    if not binary:
        return str(int(value)) if value == value.to_integral_value() else f"{math.ceil(value * 1000)}m"
    for suffix, power in (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if value >= 2 ** power and value % 2 ** power == 0:
            return f"{int(value / 2 ** power)}{suffix}"
    return str(math.ceil(value))


def shm_size(spec: api.InferenceServiceSpec, defaults: ServingDefaults) -> Decimal | None:
    """Size limit of the memory-backed /dev/shm in bytes: spec.resources.shmSize, else the operator's
    /dev/shm per GPU times tensorParallelSize when the pod runs tensor-parallel workers (they exchange
    through it: NCCL, torch.distributed), else None (no /dev/shm volume)."""
    if spec.resources.shm_size is not None:
        return quantity(spec.resources.shm_size)
    tp = spec.engine.tensor_parallel_size
    return quantity(defaults.shm_per_gpu) * tp if tp > 1 else None


def container_resources(spec: api.InferenceServiceSpec, defaults: ServingDefaults,
                        shm: Decimal | None) -> dict[str, Any]:
    """The server container's resources. GPUs as a limit of gpuResourceName. CPU: a request of
    spec.resources.cpu, else on GPU pods the operator's CPUs per GPU times gpus (no CPU limit:
    throttling hurts decode). Memory: spec.resources.memory as request and limit, which must exceed
    the /dev/shm size (a memory-backed emptyDir counts against the container's memory); else on GPU
    pods a request of the memory per GPU times gpus plus the /dev/shm size. CPU pods get no default.
    Raises Unrealisable (InvalidSpec, naming spec.resources.memory)."""
    res = spec.resources
    gpus = spec.gpus
    out: dict[str, dict[str, str]] = {}
    if gpus > 0:
        out.setdefault("limits", {})[res.gpu_resource_name] = str(gpus)
    if res.cpu is not None:
        out.setdefault("requests", {})["cpu"] = str(res.cpu)
    elif gpus > 0:
        out.setdefault("requests", {})["cpu"] = format_quantity(quantity(defaults.cpu_per_gpu) * gpus, binary=False)
    if res.memory is not None:
        if shm is not None and quantity(res.memory) <= shm:
            raise Unrealisable("InvalidSpec", f"spec.resources.memory ({res.memory}) must exceed the /dev/shm size "
                                              f"({format_quantity(shm, binary=True)}, spec.resources.shmSize): a "
                                              f"memory-backed emptyDir counts against the container's memory")
        out.setdefault("requests", {})["memory"] = str(res.memory)
        out.setdefault("limits", {})["memory"] = str(res.memory)
    elif gpus > 0:
        out.setdefault("requests", {})["memory"] = format_quantity(
            quantity(defaults.memory_per_gpu) * gpus + (shm or 0), binary=True)
    return out


def spread_constraints(spec: api.InferenceServiceSpec, name: str) -> list[dict[str, Any]]:
    """spec.scheduling.topologySpreadConstraints, else replicas spread across nodes: maxSkew 1 on
    kubernetes.io/hostname, ScheduleAnyway (a full cluster still schedules, a second node is preferred),
    counted per ReplicaSet (matchLabelKeys pod-template-hash) so a rollout's new pods spread too."""
    if spec.scheduling.topology_spread_constraints is not None:
        return list(spec.scheduling.topology_spread_constraints)
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector_labels(name)}, "matchLabelKeys": ["pod-template-hash"]}]


# ---------------------------------------------------------------------------------------- render
@dataclass(frozen=True)
class Children:
    """The rendered children of one InferenceService (pdb is None when not wanted; routing is None without
    spec.routing.inferencePool, see routing.py)."""
    deployment: dict[str, Any]
    service: dict[str, Any]
    pdb: dict[str, Any] | None
    routing: routing.RoutingChildren | None = None


def _meta(obj: dict[str, Any], kind_labels: dict[str, str]) -> dict[str, Any]:
    meta = obj["metadata"]
    out: dict[str, Any] = {"name": meta["name"], "namespace": meta.get("namespace") or "default",
                           "labels": dict(kind_labels)}
    ref = owner_reference(obj)
    if ref is not None:
        out["ownerReferences"] = [ref]
    return out


def container_security_context() -> dict[str, Any]:
    """The restricted security context of every container the operator renders (server and downloads)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security_context() -> dict[str, Any]:
    """Pod security context of the serving pods and download Jobs. OnRootMismatch: no recursive chown of
    a large model-cache volume at every pod start."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def downloader(spec: api.InferenceServiceSpec, defaults: "ServingDefaults",
               hf_endpoint: str | None = None) -> cache.Downloader:
    """How this spec's download containers run: kvfleet's serving image (it ships ``kvfleet-download``;
    with runtime vllm the operator's kvfleet image, since the vLLM image has no downloader),
    engine.env (credentials come only from spec.model.credentialsSecret), the Hub the operator resolved
    against."""
    e = spec.engine
    env = [v.model_dump(by_alias=True, exclude_none=True) for v in e.env]
    names = {v["name"] for v in env}
    env += [{"name": k, "value": v} for k, v in (("HOME", "/tmp"), ("HF_HOME", "/tmp/.hf-home")) if k not in names]
    own = e.runtime == runtime.KVFLEET
    return cache.Downloader((e.image if own else None) or defaults.image,
                            (e.image_pull_policy if own else None) or defaults.pull_policy, env,
                            hf_endpoint, container_security_context())


def render(obj: dict[str, Any], replicas: int | None = None,
           defaults: ServingDefaults = ServingDefaults(),
           routing_defaults: routing.RoutingDefaults = routing.RoutingDefaults(),
           kubernetes_version: str = strict.NEWEST, pins: Mapping[str, Pin] | None = None,
           hf_endpoint: str | None = None) -> Children:
    """Render the children of InferenceService ``obj``.

    replicas: the Deployment's replica count (see ``desired_replicas``); None means
    ``desired_replicas(spec, None, status.desiredReplicas)``. defaults: what the spec leaves to the
    operator (image, pull policy, per-GPU sizing); routing_defaults: the endpoint picker image.
    kubernetes_version: the children are checked against this version's strict schema
    (``strict.kubernetes_version`` of the API server's). pins: the revision of each downloaded model
    uri (``weights`` resolves them; unpinned sources are rendered at the revision asked for),
    hf_endpoint: the Hub they were resolved against.
    Raises Unrealisable: InvalidSpec naming the spec field (an unknown field in scheduling.affinity
    is ``spec.scheduling.affinity.FIELD: unknown field``), ChildInvalid for a rendered field no
    spec field maps to."""
    spec = parse_spec(obj)
    name = obj["metadata"]["name"]
    if replicas is None:
        replicas = desired_replicas(spec, None, (obj.get("status") or {}).get("desiredReplicas"))
    labels = common_labels(name)
    dl = downloader(spec, defaults, hf_endpoint)
    storage = cache.pod_storage(obj, spec, pins, dl)
    e = spec.engine
    args = container_args(spec, server_args(spec, storage.paths) + routing.server_args(spec))
    server = runtime.RUNTIMES[e.runtime]
    image, pull_policy = e.image or defaults.image_for(e.runtime), e.image_pull_policy or defaults.pull_policy

    env = dl.env + routing.server_env(spec)  # engine.env, HOME, HF_HOME: never a credential (api refuses them)
    volumes = [{"name": "tmp", "emptyDir": {}}] + storage.volumes
    volume_mounts = [{"name": "tmp", "mountPath": "/tmp"}] + storage.mounts
    shm = shm_size(spec, defaults)
    if shm is not None:  # the tensor-parallel workers' NCCL / torch.distributed buffers
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     "sizeLimit": format_quantity(shm, binary=True)}})
        volume_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    resources = container_resources(spec, defaults, shm)
    if storage.ephemeral_storage is not None:  # the emptyDir model cache: the scheduler must see that disk
        resources.setdefault("requests", {})["ephemeral-storage"] = storage.ephemeral_storage

    period, failures = startup_probe_timing(spec.probes.startup_timeout_seconds)
    health = {"path": "/health", "port": HTTP_PORT_NAME}
    container: dict[str, Any] = {
        "name": SERVER_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": list(server.command),
        "args": args,
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": spec.service.port, "protocol": "TCP"},
                  *routing.server_ports(spec)],
        "env": env,
        "resources": resources,
        "volumeMounts": volume_mounts,
        "startupProbe": {"httpGet": health, "periodSeconds": period, "failureThreshold": failures,
                         "timeoutSeconds": 1},
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": health, "periodSeconds": 10, "failureThreshold": 6, "timeoutSeconds": 5},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": container_security_context(),
        # the server's last stderr line ("not supported yet: ...") reaches status and `kubectl get infsvc`
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    sched = spec.scheduling
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,  # a Service named like the server would inject *_PORT env vars
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    spread = spread_constraints(spec, name)
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if storage.init_containers:
        pod_spec["initContainers"] = storage.init_containers
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": r.name} for r in spec.image_pull_secrets]
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in sched.tolerations]
    if sched.affinity:
        pod_spec["affinity"] = sched.affinity
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod_spec["runtimeClassName"] = sched.runtime_class_name

    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_meta(obj, labels), **({"annotations": cache.revisions_annotation(storage)}
                                               if storage.revisions else {})},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "progressDeadlineSeconds": spec.probes.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": dict(labels),
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(spec.service.port),
                                    "prometheus.io/path": "/metrics",
                                    **({ADAPTERS_ANNOTATION: ",".join(a.name for a in spec.adapters)}
                                       if spec.adapters else {})},
                },
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(obj, labels),
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(name),
            "ports": [{"name": HTTP_PORT_NAME, "port": spec.service.port, "targetPort": HTTP_PORT_NAME,
                       "protocol": "TCP", "appProtocol": "http"}],
        },
    }
    most = (spec.autoscaling.max_replicas or 1) if spec.autoscaling.enabled else replicas
    pdb = None
    if most > 1:
        pdb = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(obj, labels),
            # AlwaysAllow: a pod that is not ready (crash loop, still loading) may be evicted even when the
            # budget is spent, so one failing replica never blocks a node drain
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"},
        }
    invalid = strict.check([c for c in (deployment, service, pdb) if c is not None], kubernetes_version,
                           instance=(name, obj["metadata"].get("uid") or ""))
    if invalid:
        reason = "InvalidSpec" if all(field for field, _ in invalid) else "ChildInvalid"
        raise Unrealisable(reason, "; ".join(message for _, message in invalid)
                           + f" (the Kubernetes {kubernetes_version} schema)")
    routed = routing.render(obj, spec, routing_defaults, labels=labels, selector=selector_labels(name),
                            owner=owner_reference(obj))
    return Children(deployment=deployment, service=service, pdb=pdb, routing=routed)
