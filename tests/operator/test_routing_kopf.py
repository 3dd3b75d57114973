"""spec.routing with the real kopf runtime against KMock: the routing objects are created, owned, updated on a
spec change and removed with it; a missing Gateway or missing CRDs make the InferenceService Degraded with a
message that says what to install, and the serving children are there all the same.

A CRD that is not installed is a resource KMock does not declare: its discovery document and its objects
answer 404, as a real API server's do.
"""
from __future__ import annotations

import copy

import kmock
import yaml

from kmock_support import assert_operator_never_wrote_spec, running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import routing

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
NS = "default"
ISVC = {"apiVersion": AV, "kind": "InferenceService", "metadata": {"name": "chat", "namespace": NS},
        "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}, "replicas": 2,
                 "routing": {"inferencePool": {"gateway": {"name": "gw"}}}}}
EPP_OBJECTS = [(av, plural) for field, av, plural in routing.KINDS if field not in ("inference_pool", "http_route")]


def register_routing(emulator, *, inference_pool: bool = True, gateway_api: bool = True) -> None:
    """Declare what a cluster with the GIE CRDs (``inference_pool``) and the Gateway API CRDs has."""
    verbs = {"list", "watch", "get", "create", "patch", "update", "delete"}
    r = emulator.resources
    for key, kind in (("v1/configmaps", "ConfigMap"), ("v1/serviceaccounts", "ServiceAccount"),
                      ("rbac.authorization.k8s.io/v1/roles", "Role"),
                      ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding")):
        r[key] = kmock.ResourceInfo(kind=kind, singular=kind.lower(), namespaced=True, verbs=verbs)
    if inference_pool:
        r["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
            kind="InferencePool", singular="inferencepool", namespaced=True, verbs=verbs, subresources={"status"})
    if gateway_api:
        for plural, kind in (("httproutes", "HTTPRoute"), ("gateways", "Gateway")):
            r[f"gateway.networking.k8s.io/v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=True, verbs=verbs, subresources={"status"})


def gateway(name: str = "gw") -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {"name": name, "namespace": NS},
            "spec": {"gatewayClassName": "envoy", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}}


def cond(obj: dict | None, type_: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def degraded(api, reason: str) -> dict:
    async def check():
        o = await api.get(AV, PL, NS, "chat")
        return o if cond(o, "Degraded").get("reason") == reason else None
    check.__name__ = f"Degraded {reason}"
    return await wait_for(check, timeout=30)


async def routing_objects(api) -> dict[str, dict | None]:
    out = {}
    for field, av, plural in routing.KINDS:
        name = "chat" if field in ("inference_pool", "http_route") else "chat-epp"
        out[field] = await api.get(av, plural, NS, name)
    return out


async def test_routing_objects_are_created_owned_updated_and_removed(api, emulator):
    register_routing(emulator)
    await api.create("gateway.networking.k8s.io/v1", "gateways", NS, gateway())
    async with running_operator():
        created = await api.create(AV, PL, NS, copy.deepcopy(ISVC))
        uid = created["metadata"]["uid"]

        async def all_there():
            objs = await routing_objects(api)
            return objs if all(objs.values()) else None
        objs = await wait_for(all_there, timeout=30)
        for obj in objs.values():
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["uid"], ref["controller"], ref["kind"]) == (uid, True, "InferenceService")
        pool = objs["inference_pool"]
        assert pool["spec"]["endpointPickerRef"]["name"] == objs["epp_service"]["metadata"]["name"] == "chat-epp"
        assert pool["spec"]["selector"]["matchLabels"] == \
            (await api.get("apps/v1", "deployments", NS, "chat"))["spec"]["selector"]["matchLabels"]
        assert objs["http_route"]["spec"]["parentRefs"][0]["name"] == "gw"

        async def routing_status(expected):
            async def check():
                o = await api.get(AV, PL, NS, "chat")
                return o if (o.get("status") or {}).get("routing") == expected else None
            check.__name__ = f"status.routing == {expected}"
            return await wait_for(check, timeout=30)
        live = await routing_status({"inferencePool": "chat", "endpointPicker": "chat-epp",
                                     "prefixCache": "approximate", "httpRoute": "chat", "gateway": "default/gw"})
        assert cond(live, "Degraded")["status"] == "False"

        # a spec change: precise prefix routing with 32-token blocks -> the picker's config and the servers follow
        checksum = objs["epp_deployment"]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        await api.patch(AV, PL, NS, "chat", {"spec": {"engine": {"blockSize": 32}, "routing": {"inferencePool": {
            "endpointPicker": {"prefixCache": "precise"}}}}})

        async def updated():
            cm = await api.get("v1", "configmaps", NS, "chat-epp")
            cfg = yaml.safe_load(cm["data"][routing.EPP_CONFIG_FILE])
            producers = [p for p in cfg["plugins"] if p["type"] == "precise-prefix-cache-producer"]
            epp = await api.get("apps/v1", "deployments", NS, "chat-epp")  # restarted with the new config
            return producers and producers[0]["parameters"]["tokenProcessorConfig"]["blockSizeTokens"] == 32 \
                and epp["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != checksum
        await wait_for(updated, timeout=30)
        dep = await api.get("apps/v1", "deployments", NS, "chat")
        assert "--kv-events-config" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        await routing_status({"inferencePool": "chat", "endpointPicker": "chat-epp", "prefixCache": "precise",
                              "httpRoute": "chat", "gateway": "default/gw"})

        # an owned InferencePool deleted by hand is put back (the operator watches them)
        old_uid = pool["metadata"]["uid"]
        await api.delete(routing.POOL_API_VERSION, "inferencepools", NS, "chat")

        async def recreated():
            p = await api.get(routing.POOL_API_VERSION, "inferencepools", NS, "chat")
            return p if p and p["metadata"]["uid"] != old_uid else None
        await wait_for(recreated, timeout=30)

        # the gateway removed: the HTTPRoute goes, the pool stays
        await api.patch(AV, PL, NS, "chat", {"spec": {"routing": {"inferencePool": {"gateway": None}}}})
        await wait_for(lambda: _absent(api, routing.ROUTE_API_VERSION, "httproutes", "chat"), timeout=30)
        await routing_status({"inferencePool": "chat", "endpointPicker": "chat-epp", "prefixCache": "precise"})
        assert await api.get(routing.POOL_API_VERSION, "inferencepools", NS, "chat") is not None

        # routing removed: every routing object goes, the serving children stay
        await api.patch(AV, PL, NS, "chat", {"spec": {"routing": None}})

        async def all_gone():
            return not any((await routing_objects(api)).values())
        await wait_for(all_gone, timeout=30)
        await routing_status(None)
        dep = await api.get("apps/v1", "deployments", NS, "chat")
        assert "--kv-events-config" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert await api.get("v1", "services", NS, "chat") is not None
    assert_operator_never_wrote_spec(emulator.writes)


async def _absent(api, av, plural, name):
    return await api.get(av, plural, NS, name) is None


async def test_a_missing_gateway_is_degraded_until_it_exists(api, emulator):
    register_routing(emulator)
    async with running_operator():
        await api.create(AV, PL, NS, copy.deepcopy(ISVC))
        live = await degraded(api, "GatewayNotFound")
        c = cond(live, "Degraded")
        assert c["status"] == "True"
        assert c["message"] == "spec.routing.inferencePool.gateway: Gateway default/gw not found"
        # the replicas serve through their Service meanwhile; nothing of the routing was written
        assert await api.get("apps/v1", "deployments", NS, "chat") is not None
        assert not any((await routing_objects(api)).values())

        await api.create("gateway.networking.k8s.io/v1", "gateways", NS, gateway())  # retried with backoff
        await degraded(api, "ReconcileSucceeded")
        assert await api.get(routing.ROUTE_API_VERSION, "httproutes", NS, "chat") is not None


async def test_missing_crds_are_degraded_with_what_to_install(api, emulator):
    register_routing(emulator, inference_pool=False, gateway_api=False)
    async with running_operator():
        await api.create(AV, PL, NS, copy.deepcopy(ISVC))
        live = await degraded(api, "InferencePoolCRDMissing")
        message = cond(live, "Degraded")["message"]
        assert message.startswith("spec.routing.inferencePool: the API server does not serve "
                                  "inferencepools.inference.networking.k8s.io/v1: install the Gateway API Inference "
                                  "Extension CRDs")
        assert "routing.installInferencePoolCRD" in message
        assert await api.get("apps/v1", "deployments", NS, "chat") is not None
        for av, plural in EPP_OBJECTS:  # nothing half-made
            assert await api.get(av, plural, NS, "chat-epp") is None

    emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = kmock.ResourceInfo(
        kind="InferencePool", singular="inferencepool", namespaced=True,
        verbs={"list", "watch", "get", "create", "patch", "delete"})
    async with running_operator():  # the GIE CRD installed, not the Gateway API's
        live = await degraded(api, "GatewayAPICRDMissing")
        assert cond(live, "Degraded")["message"].startswith(
            "spec.routing.inferencePool.gateway: the API server does not serve httproutes.gateway.networking.k8s.io/v1")
