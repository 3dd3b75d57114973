"""Pure rendering of spec.routing.inferencePool: the Gateway API Inference Extension objects of one
InferenceService (no I/O). docs/routing.md explains the choices.

``render(obj, spec, defaults)`` returns ``RoutingChildren`` (None without routing):

- an ``InferencePool`` (inference.networking.k8s.io/v1) named like the InferenceService, selecting exactly
  the serving pods (the Deployment's selector labels) on the server port, whose ``endpointPickerRef``
  names the endpoint picker's Service;
- the endpoint picker (EPP, llm-d-router's ``llm-d-router-endpoint-picker``, pinned by the chart):
  Deployment, Service (ext_proc gRPC 9002, metrics 9090), ServiceAccount, Role + RoleBinding (``EPP_RULES``:
  read-only), and a ConfigMap holding its ``EndpointPickerConfig`` (``epp_config``);
- an ``HTTPRoute`` (gateway.networking.k8s.io/v1) from the named Gateway to the pool, when a gateway is set.

``server_args`` / ``server_ports`` are what the serving container needs for precise prefix routing: the
``--kv-events-config`` that publishes its block pool's events where the EPP subscribes (port 5557, replay
5558) — the same layout as llm-d's defaults.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import yaml

from . import api

POOL_API_VERSION = "inference.networking.k8s.io/v1"
ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
#: the endpoint picker, pinned: llm-d-router v0.10.0 (2026-08-17), the EPP that moved out of GIE v1.6
DEFAULT_EPP_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
EPP_CONFIG_API_VERSION = "llm-d.ai/v1alpha1"  # EndpointPickerConfig of llm-d-router >= 0.9
EPP_CONFIG_FILE = "epp.yaml"
EPP_GRPC_PORT = 9002  # ext_proc, what the Gateway calls (endpointPickerRef.port)
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_TERMINATION_GRACE_SECONDS = 130  # upstream: the longest grace period of the pool's pods
KV_EVENTS_PORT = 5557  # llm-d's podDiscoveryConfig.socketPort default
KV_REPLAY_PORT = 5558
KV_EVENTS_TOPIC_PREFIX = "kv@"  # llm-d's topicFilter default; the topic is kv@POD_IP@MODEL
#: the approximate prefix index of llm-d-router clamps blocks below 64 tokens up to 64
EPP_MIN_BLOCK_TOKENS = 64
#: scheduling weights of llm-d-router's default profile (queue 2, KV usage 2, prefix 3)
WEIGHTS = {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
#: what the endpoint picker reads, all read-only: the pool it serves and its pods, and the optional
#: InferenceObjective / InferenceModelRewrite objects llm-d-router watches when their CRDs exist. The
#: operator holds these verbs itself (Kubernetes lets a Role grant only what its creator holds).
EPP_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["llm-d.ai"], "resources": ["inferenceobjectives", "inferencemodelrewrites"],
     "verbs": ["get", "list", "watch"]},
]


@dataclass(frozen=True)
class RoutingDefaults:
    """What an InferenceService leaves to the operator: the endpoint picker image (the chart's
    routing.endpointPickerImage, given to the operator as KVFLEET_EPP_IMAGE)."""
    epp_image: str = DEFAULT_EPP_IMAGE

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "RoutingDefaults":
        return cls(epp_image=env.get("KVFLEET_EPP_IMAGE") or DEFAULT_EPP_IMAGE)


@dataclass(frozen=True)
class RoutingChildren:
    """The rendered routing objects of one InferenceService, in apply order (http_route None without a gateway)."""
    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]
    config_map: dict[str, Any]
    epp_service: dict[str, Any]
    epp_deployment: dict[str, Any]
    inference_pool: dict[str, Any]
    http_route: dict[str, Any] | None


#: (field of RoutingChildren, apiVersion, plural) in apply order; the reconcile deletes in reverse order
KINDS = (("service_account", "v1", "serviceaccounts"),
         ("role", "rbac.authorization.k8s.io/v1", "roles"),
         ("role_binding", "rbac.authorization.k8s.io/v1", "rolebindings"),
         ("config_map", "v1", "configmaps"),
         ("epp_service", "v1", "services"),
         ("epp_deployment", "apps/v1", "deployments"),
         ("inference_pool", POOL_API_VERSION, "inferencepools"),
         ("http_route", ROUTE_API_VERSION, "httproutes"))
KINDS_DELETE_ORDER = tuple(reversed(KINDS))


def epp_name(name: str) -> str:
    """Name of the endpoint picker's objects (Deployment, Service, ServiceAccount, Role, RoleBinding, ConfigMap)."""
    return f"{name}-epp"


def epp_selector_labels(name: str) -> dict[str, str]:
    """Labels selecting the endpoint picker's pod (never the serving pods: another app.kubernetes.io/name)."""
    return {"app.kubernetes.io/name": "kvfleet-endpoint-picker", "app.kubernetes.io/instance": name}


def gateway_namespace(pool: api.InferencePoolRouting, namespace: str) -> str:
    return (pool.gateway.namespace if pool.gateway is not None and pool.gateway.namespace else None) or namespace


def epp_block_tokens(block_size: int) -> int:
    """Prefix block of the approximate index: the engine's block, raised to llm-d-router's 64-token floor
    (every engine block size the CRD allows, 8-128, divides the result: EPP blocks hold whole engine blocks)."""
    return max(EPP_MIN_BLOCK_TOKENS, block_size)


def kv_events_config(spec: api.InferenceServiceSpec) -> dict[str, Any]:
    """--kv-events-config of a serving pod in precise mode (vLLM's keys; ``$(POD_IP)`` is expanded by the kubelet)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
            "topic": f"{KV_EVENTS_TOPIC_PREFIX}$(POD_IP)@{spec.served_model_name}"}


def precise(spec: api.InferenceServiceSpec) -> bool:
    pool = spec.routing.inference_pool
    return pool is not None and pool.endpoint_picker.prefix_cache == "precise"


def server_args(spec: api.InferenceServiceSpec) -> list[str]:
    """Flags the serving container adds for routing (precise prefix routing only)."""
    if not precise(spec):
        return []
    return ["--kv-events-config", json.dumps(kv_events_config(spec), sort_keys=True, separators=(",", ":"))]


def server_ports(spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    """Container ports the serving container adds for routing (the KV-events PUB and replay sockets)."""
    if not precise(spec):
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]


def server_env(spec: api.InferenceServiceSpec) -> list[dict[str, Any]]:
    """Environment the serving container adds for routing (POD_IP, named in the KV-events topic)."""
    if not precise(spec):
        return []
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def epp_config(spec: api.InferenceServiceSpec, name: str, namespace: str) -> dict[str, Any]:
    """The endpoint picker's EndpointPickerConfig (llm-d.ai/v1alpha1, llm-d-router 0.10's plugin names).

    Scorers: queue depth (vllm:num_requests_waiting), KV-cache usage (vllm:kv_cache_usage_perc) and prefix
    cache, weighted 2/2/3 as llm-d-router's default profile, highest score wins. The metrics come from each
    serving pod's /metrics through ``core-metrics-extractor`` (vLLM's names, which kvfleet-server exports,
    vllm:cache_config_info's block_size and num_gpu_blocks included).

    Prefix cache, approximate: ``approx-prefix-cache-producer`` hashes the prompts it routes in blocks of
    ``epp_block_tokens(engine.blockSize)`` and sizes each pod's LRU index from num_gpu_blocks (autoTune).
    Precise: ``token-producer`` tokenizes the prompt with the served model's own tokenizer (kvfleet-server's
    /v1/completions/render behind the InferenceService's Service), ``precise-prefix-cache-producer`` keys
    blocks of exactly engine.blockSize tokens and learns which pod holds which block from each pod's KV
    events (``endpoint-notification-source`` tells it the pool's pods; it dials port 5557, replays from 5558).
    """
    bs = spec.engine.block_size
    metrics = {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}}
    sources = [{"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]
    if precise(spec):
        producer = "precise-prefix-cache-producer"
        prefix = [
            {"type": "token-producer",
             "parameters": {"modelName": spec.served_model_name,
                            "vllm": {"url": f"http://{name}.{namespace}.svc:{spec.service.port}"}}},
            {"type": "endpoint-notification-source"},
            {"type": producer,
             "parameters": {"tokenProcessorConfig": {"blockSizeTokens": bs},
                            "kvEventsConfig": {"topicFilter": KV_EVENTS_TOPIC_PREFIX, "discoverPods": True,
                                               "podDiscoveryConfig": {"socketPort": KV_EVENTS_PORT,
                                                                      "replaySocketPort": KV_REPLAY_PORT}}}},
        ]
        sources.append({"pluginRef": "endpoint-notification-source", "extractors": [{"pluginRef": producer}]})
    else:
        producer = "approx-prefix-cache-producer"
        prefix = [{"type": producer, "parameters": {"autoTune": True, "blockSizeTokens": epp_block_tokens(bs)}}]
    plugins = [metrics, {"type": "core-metrics-extractor"}, *prefix,
               {"type": "prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": producer}},
               {"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}, {"type": "max-score-picker"}]
    profile = [{"pluginRef": p, "weight": w} for p, w in WEIGHTS.items()] + [{"pluginRef": "max-score-picker"}]
    return {"apiVersion": EPP_CONFIG_API_VERSION, "kind": "EndpointPickerConfig", "plugins": plugins,
            "dataLayer": {"sources": sources}, "schedulingProfiles": [{"name": "default", "plugins": profile}]}


def render(obj: dict[str, Any], spec: api.InferenceServiceSpec, defaults: RoutingDefaults = RoutingDefaults(),
           *, labels: dict[str, str], selector: dict[str, str], owner: dict[str, Any] | None) -> RoutingChildren | None:
    """The routing objects of InferenceService ``obj`` (parsed ``spec``), or None without spec.routing.inferencePool.

    labels: the app.kubernetes.io labels every child carries; selector: the serving pods' selector labels
    (the Deployment's); owner: the controller ownerReference (None before the object has a uid)."""
    pool = spec.routing.inference_pool
    if pool is None:
        return None
    name = obj["metadata"]["name"]
    namespace = obj["metadata"].get("namespace") or "default"
    epp = epp_name(name)
    picker = pool.endpoint_picker
    epp_labels = {**labels, **epp_selector_labels(name), "app.kubernetes.io/component": "endpoint-picker"}
    pod_labels = {**epp_selector_labels(name), "app.kubernetes.io/component": "endpoint-picker",
                  "app.kubernetes.io/part-of": "kvfleet"}

    def meta(obj_name: str, obj_labels: dict[str, str]) -> dict[str, Any]:
        out: dict[str, Any] = {"name": obj_name, "namespace": namespace, "labels": dict(obj_labels)}
        if owner is not None:
            out["ownerReferences"] = [dict(owner)]
        return out

    service_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(epp, epp_labels)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(epp, epp_labels),
            "rules": [dict(r) for r in EPP_RULES]}
    role_binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": meta(epp, epp_labels),
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": epp},
                    "subjects": [{"kind": "ServiceAccount", "name": epp, "namespace": namespace}]}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(epp, epp_labels),
                  "data": {EPP_CONFIG_FILE: yaml.safe_dump(epp_config(spec, name, namespace), sort_keys=False)}}
    epp_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta(epp, epp_labels),
        "spec": {"type": "ClusterIP", "selector": epp_selector_labels(name),
                 "ports": [{"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                           {"name": "http-metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics",
                            "protocol": "TCP"}]}}
    container = {
        "name": "epp",
        "image": picker.image or defaults.epp_image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["--pool-name", name, "--pool-namespace", namespace, "--pool-group", "inference.networking.k8s.io",
                 "--config-file", f"/config/{EPP_CONFIG_FILE}", "--grpc-health-port", str(EPP_HEALTH_PORT),
                 "--zap-encoder", "json", "--tracing=false"],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "resources": {"requests": {"cpu": str(picker.resources.cpu), "memory": str(picker.resources.memory)},
                      "limits": {"memory": double_quantity(picker.resources.memory)}},
        "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"},
                          "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 2},
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    epp_deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(epp, epp_labels),
        "spec": {
            "replicas": 1,  # the prefix index lives in memory: one active picker (upstream runs active-passive)
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": epp_selector_labels(name)},
            "template": {
                "metadata": {"labels": pod_labels,
                             "annotations": {"checksum/config": _checksum(config_map["data"])}},
                "spec": {"serviceAccountName": epp, "terminationGracePeriodSeconds": EPP_TERMINATION_GRACE_SECONDS,
                         "containers": [container],
                         "volumes": [{"name": "config", "configMap": {"name": epp}}]},
            },
        },
    }
    inference_pool = {
        "apiVersion": POOL_API_VERSION, "kind": "InferencePool", "metadata": meta(name, labels),
        "spec": {"selector": {"matchLabels": dict(selector)},
                 "targetPorts": [{"number": spec.service.port}],
                 "appProtocol": "http",
                 "endpointPickerRef": {"group": "", "kind": "Service", "name": epp,
                                       "port": {"number": EPP_GRPC_PORT}, "failureMode": picker.failure_mode}}}
    http_route = None
    if pool.gateway is not None:
        gw = pool.gateway
        parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw.name}
        if gateway_namespace(pool, namespace) != namespace:
            parent["namespace"] = gw.namespace
        if gw.section_name:
            parent["sectionName"] = gw.section_name
        http_route = {
            "apiVersion": ROUTE_API_VERSION, "kind": "HTTPRoute", "metadata": meta(name, labels),
            "spec": {"parentRefs": [parent],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": name}],
                                "timeouts": {"request": "300s"}}]}}
    return RoutingChildren(service_account, role, role_binding, config_map, epp_service, epp_deployment,
                           inference_pool, http_route)


def double_quantity(value: int | str) -> str:
    """Twice a Kubernetes quantity, in its own unit: "512Mi" -> "1024Mi", "1.5Gi" -> "3Gi", 2 -> "4"."""
    m = re.match(r"^([+-]?[0-9.]+)(.*)$", str(value))
    return f"{(Decimal(m.group(1)) * 2).normalize():f}" + m.group(2)


def _checksum(data: dict[str, str]) -> str:
    """Restarts the picker when its configuration changes (it reads the file at start-up)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
