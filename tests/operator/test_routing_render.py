"""spec.routing.inferencePool rendered (routing.py): every object valid, the pool selecting exactly the serving
pods, the picker wired to its Service, its configuration consistent with the engine, and nothing left when
routing is removed.

Core kinds are checked by kubernetes-validate (strict) for Kubernetes 1.30 and 1.35; InferencePool and
HTTPRoute by the published CRD schemas of GIE v1.6.0 and Gateway API v1.6.1 (tests/chart/crd_schemas.py).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvfleet_operator import admission, render, routing
from kvfleet_server.flags import parse_flags
from kvfleet_server.metrics import ServerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/chart is the package `chart`
from chart import crd_schemas  # noqa: E402

KUBE_VERSIONS = ("1.30.0", "1.35.0")
BASE = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "0b1c2d3e-0000-4000-8000-000000000001"},
        "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0, "cpu": 2}, "replicas": 3}}
VARIANTS = {
    "approximate, no gateway": {},
    "approximate, gateway here": {"gateway": {"name": "gw"}},
    "precise, gateway elsewhere": {"gateway": {"name": "gw", "namespace": "infra", "sectionName": "http"},
                                   "endpointPicker": {"prefixCache": "precise", "failureMode": "FailClose"}},
}


def isvc(pool: dict | None = None, **spec) -> dict:
    obj = copy.deepcopy(BASE)
    obj["spec"].update(spec)
    if pool is not None:
        obj["spec"]["routing"] = {"inferencePool": pool}
    return obj


def objects(children: render.Children) -> list[dict]:
    r = children.routing
    return [getattr(r, f) for f, _, _ in routing.KINDS if getattr(r, f) is not None]


def validate(obj: dict) -> None:
    if (obj["apiVersion"], obj["kind"]) in crd_schemas.CRD_SCHEMAS:
        assert crd_schemas.validate(obj) == [], obj["kind"]
    else:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("pool", VARIANTS.values(), ids=VARIANTS)
def test_every_object_is_valid_and_owned(pool):
    children = render.render(isvc(pool))
    objs = objects(children)
    kinds = [o["kind"] for o in objs]
    assert kinds[:7] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
                         "InferencePool"]
    assert ("HTTPRoute" in kinds) == ("gateway" in pool)
    for obj in [children.deployment, children.service, *objs]:
        validate(obj)
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
            ("InferenceService", "chat", BASE["metadata"]["uid"], True)
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"


def test_the_validators_are_not_no_ops():
    r = render.render(isvc({"gateway": {"name": "gw"}})).routing
    pool = copy.deepcopy(r.inference_pool)
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert "spec.targetPorts: port number must be unique" in crd_schemas.validate(pool)  # a CEL rule
    pool = copy.deepcopy(r.inference_pool)
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    assert any("failureMode" in e for e in crd_schemas.validate(pool))
    pool["spec"]["endpointPickerRef"]["prot"] = {"number": 1}
    assert "spec.endpointPickerRef.prot: unknown field" in crd_schemas.validate(pool)
    route = copy.deepcopy(r.http_route)
    route["spec"]["rules"][0]["matches"][0]["path"]["value"] = "no-slash"
    assert crd_schemas.validate(route)
    dep = copy.deepcopy(r.epp_deployment)
    dep["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)


@pytest.mark.parametrize("pool", VARIANTS.values(), ids=VARIANTS)
def test_the_pool_selects_exactly_the_serving_pods_on_the_server_port(pool):
    obj = isvc(pool, service={"port": 8080})
    children = render.render(obj)
    r = children.routing
    selector = r.inference_pool["spec"]["selector"]["matchLabels"]
    serving_pod = children.deployment["spec"]["template"]
    epp_pod = r.epp_deployment["spec"]["template"]
    assert selector == children.deployment["spec"]["selector"]["matchLabels"] == children.service["spec"]["selector"]
    assert selector.items() <= serving_pod["metadata"]["labels"].items()
    assert not selector.items() <= epp_pod["metadata"]["labels"].items()  # the picker is not a backend
    (container,) = serving_pod["spec"]["containers"]
    http = next(p for p in container["ports"] if p["name"] == "http")
    assert r.inference_pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}] == [{"number": 8080}]


@pytest.mark.parametrize("pool", VARIANTS.values(), ids=VARIANTS)
def test_endpoint_picker_ref_names_the_rendered_service(pool):
    r = render.render(isvc(pool)).routing
    ref = r.inference_pool["spec"]["endpointPickerRef"]
    svc = r.epp_service
    assert (ref["kind"], ref["group"], ref["name"]) == ("Service", "", svc["metadata"]["name"])
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    (container,) = r.epp_deployment["spec"]["template"]["spec"]["containers"]
    target = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    assert target["containerPort"] == ref["port"]["number"] == routing.EPP_GRPC_PORT
    assert svc["spec"]["selector"].items() <= r.epp_deployment["spec"]["template"]["metadata"]["labels"].items()
    assert ref["failureMode"] == pool.get("endpointPicker", {}).get("failureMode", "FailOpen")
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == r.inference_pool["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == "team-a"
    # the picker reads its configuration from the rendered ConfigMap
    volume = next(v for v in r.epp_deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == r.config_map["metadata"]["name"]
    assert args[args.index("--config-file") + 1] == f"/config/{routing.EPP_CONFIG_FILE}"
    assert routing.EPP_CONFIG_FILE in r.config_map["data"]
    # its ServiceAccount is bound to a read-only Role
    assert r.epp_deployment["spec"]["template"]["spec"]["serviceAccountName"] == r.service_account["metadata"]["name"]
    assert r.role_binding["subjects"] == [{"kind": "ServiceAccount", "name": r.service_account["metadata"]["name"],
                                           "namespace": "team-a"}]
    assert r.role_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                         "name": r.role["metadata"]["name"]}
    assert {v for rule in r.role["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert {res for rule in r.role["rules"] for res in rule["resources"]} >= {"pods", "inferencepools"}


def test_the_http_route_sends_the_named_gateways_traffic_to_the_pool():
    r = render.render(isvc(VARIANTS["precise, gateway elsewhere"])).routing
    spec = r.http_route["spec"]
    assert spec["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw",
                                   "namespace": "infra", "sectionName": "http"}]
    (rule,) = spec["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": r.inference_pool["metadata"]["name"]}]
    same_ns = render.render(isvc({"gateway": {"name": "gw", "namespace": "team-a"}})).routing.http_route
    assert "namespace" not in same_ns["spec"]["parentRefs"][0]


def _config(pool: dict, block_size: int = 16) -> dict:
    r = render.render(isvc(pool, engine={"blockSize": block_size})).routing
    return yaml.safe_load(r.config_map["data"][routing.EPP_CONFIG_FILE])


def _plugin(cfg: dict, type_: str) -> dict:
    (p,) = [p for p in cfg["plugins"] if p["type"] == type_]
    return p


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_prefix_scorer_is_consistent_with_the_engines_block_size(block_size):
    approx = _plugin(_config({}, block_size), "approx-prefix-cache-producer")["parameters"]
    assert approx["blockSizeTokens"] % block_size == 0 and approx["blockSizeTokens"] >= routing.EPP_MIN_BLOCK_TOKENS
    assert approx["autoTune"] is True  # block size and LRU size from vllm:cache_config_info
    precise = _config({"endpointPicker": {"prefixCache": "precise"}}, block_size)
    producer = _plugin(precise, "precise-prefix-cache-producer")["parameters"]
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == block_size
    for cfg, name in ((_config({}, block_size), "approx-prefix-cache-producer"),
                      (precise, "precise-prefix-cache-producer")):
        scorer = _plugin(cfg, "prefix-cache-scorer")["parameters"]
        assert scorer["prefixMatchInfoProducerName"] == name
        (profile,) = cfg["schedulingProfiles"]
        refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
        assert refs == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3,
                        "max-score-picker": None}
        declared = {p.get("name", p["type"]) for p in cfg["plugins"]}
        assert set(refs) <= declared
        assert {e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]} | \
            {s["pluginRef"] for s in cfg["dataLayer"]["sources"]} <= declared
        assert cfg["apiVersion"] == "llm-d.ai/v1alpha1" and cfg["kind"] == "EndpointPickerConfig"


def test_the_scorers_read_metrics_kvfleet_server_exports():
    """core-metrics-extractor's vLLM defaults (llm-d-router 0.10: extractor/metrics/factories.go) are series
    of kvfleet-server's own registry, cache_config_info with the block_size and num_gpu_blocks labels."""
    cfg = _config({})
    assert _plugin(cfg, "metrics-data-source")["parameters"] == {"scheme": "http", "path": "/metrics"}
    assert "parameters" not in _plugin(cfg, "core-metrics-extractor")  # defaultEngine vllm
    m = ServerMetrics("chat", log_stats_interval_s=None)
    m.set_cache_config(block_size=16, num_gpu_blocks=4096, enable_prefix_caching=True,
                       gpu_memory_utilization=0.9, kv_cache_dtype="auto")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert name in families, name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "4096"


def test_precise_routing_turns_on_the_servers_kv_events_where_the_picker_listens():
    obj = isvc({"endpointPicker": {"prefixCache": "precise"}}, model={"uri": "bundled://smollm2", "name": "tiny"})
    children = render.render(obj)
    (container,) = children.deployment["spec"]["template"]["spec"]["containers"]
    args = parse_flags(container["args"])  # kvfleet-server accepts the rendered command line
    kv = args.kv_events_config
    producer = _plugin(yaml.safe_load(children.routing.config_map["data"][routing.EPP_CONFIG_FILE]),
                       "precise-prefix-cache-producer")["parameters"]["kvEventsConfig"]
    assert kv.publishes and kv.endpoint == f"tcp://*:{producer['podDiscoveryConfig']['socketPort']}"
    assert kv.replay_endpoint == f"tcp://*:{producer['podDiscoveryConfig']['replaySocketPort']}"
    assert kv.topic.startswith(producer["topicFilter"]) and kv.topic == "kv@$(POD_IP)@tiny"
    assert producer["discoverPods"] is True  # a subscriber per pool pod, from endpoint-notification-source
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    tokens = _plugin(yaml.safe_load(children.routing.config_map["data"][routing.EPP_CONFIG_FILE]),
                     "token-producer")["parameters"]
    assert tokens == {"modelName": "tiny", "vllm": {"url": "http://chat.team-a.svc:8000"}}  # the pool's Service
    approx = render.render(isvc({}))
    assert "--kv-events-config" not in approx.deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_removing_routing_removes_the_objects():
    routed = render.render(isvc(VARIANTS["precise, gateway elsewhere"]))
    plain = render.render(isvc())
    assert routed.routing is not None and plain.routing is None
    assert render.render(isvc({"gateway": {"name": "gw"}})).routing.http_route is not None
    assert render.render(isvc({})).routing.http_route is None  # the gateway removed: no route
    (before,) = routed.deployment["spec"]["template"]["spec"]["containers"]
    (after,) = plain.deployment["spec"]["template"]["spec"]["containers"]
    assert "--kv-events-config" in before["args"] and "--kv-events-config" not in after["args"]
    assert [p["name"] for p in after["ports"]] == ["http"]
    assert plain.deployment == render.render(isvc({"endpointPicker": {"prefixCache": "approximate"}})).deployment


def test_the_picker_restarts_when_its_configuration_changes():
    a = render.render(isvc({})).routing.epp_deployment["spec"]["template"]["metadata"]["annotations"]
    b = render.render(isvc({}, engine={"blockSize": 128})).routing.epp_deployment
    assert a["checksum/config"] != b["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_endpoint_picker_settings_land():
    r = render.render(isvc({"endpointPicker": {"image": "registry.example.com/epp:v1",
                                               "resources": {"cpu": 2, "memory": "3Gi"}}}),
                      routing_defaults=routing.RoutingDefaults("unused:1")).routing
    (c,) = r.epp_deployment["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry.example.com/epp:v1"
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "6Gi"}}
    assert render.render(isvc({}), routing_defaults=routing.RoutingDefaults("chart/epp:v2")).routing \
        .epp_deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "chart/epp:v2"


@pytest.mark.parametrize("spec, message", [
    ({"engine": {"enablePrefixCaching": False}},
     "spec.routing.inferencePool.endpointPicker.prefixCache precise needs spec.engine.enablePrefixCaching"),
    ({"engine": {"extraArgs": ["--kv-events-config={}"]}},
     "spec.engine.extraArgs: --kv-events-config is rendered by"),
])
def test_precise_routing_refuses_what_would_silence_the_events(spec, message):
    obj = isvc({"endpointPicker": {"prefixCache": "precise"}}, **spec)
    with pytest.raises(render.Unrealisable) as err:
        render.render(obj)
    assert err.value.reason == "InvalidSpec" and message in err.value.message
    if "enablePrefixCaching" in json.dumps(spec):  # the CRD's CEL rule refuses it at admission too
        assert any(message in e for e in admission.validate(obj))
