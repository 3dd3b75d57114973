"""The reconcile's part for spec.routing: make the routing objects (routing.py) exist, or go away.

``sync`` is called by ``handlers._reconcile`` after the serving children are applied (a routing problem
never stops the replicas from serving through their Service). With routing set it checks first, before
writing anything, that the API server serves InferencePools (the Gateway API Inference Extension CRDs)
and, with a gateway, HTTPRoutes and the named Gateway; a missing one is reported Degraded with what to
install or fix (``render.Unrealisable``, retried with backoff: installing the CRDs or creating the
Gateway is enough). Then each object is created or three-way merge-patched like the other children
(``apply.plan``), an object in the way that this InferenceService does not control is a conflict, and an
HTTPRoute no longer wanted (gateway removed) is deleted. Without routing, the objects a previous pass
created (``status.routing`` says so) are deleted.
"""
from __future__ import annotations

import logging
from typing import Any

from . import apply, child_write, kube, render, routing


async def served(client: kube.KubeClient, api_version: str, plural: str) -> bool:
    """Whether the API server serves ``plural`` in ``api_version`` (discovery; no RBAC needed)."""
    try:
        doc = await client.request("GET", f"/apis/{api_version}")
    except kube.ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.get("name") == plural for r in (doc or {}).get("resources") or [])


async def check_prerequisites(client: kube.KubeClient, pool: Any, namespace: str) -> None:
    """Raise Unrealisable (retryable) when a CRD or the Gateway the routing needs is missing."""
    if not await served(client, routing.POOL_API_VERSION, "inferencepools"):
        raise render.Unrealisable(
            "InferencePoolCRDMissing",
            f"spec.routing.inferencePool: the API server does not serve inferencepools.{routing.POOL_API_VERSION}: "
            f"install the Gateway API Inference Extension CRDs (chart value routing.installInferencePoolCRD, or "
            f"docs/routing.md)", retryable=True)
    gw = pool.gateway
    if gw is None:
        return
    if not await served(client, routing.ROUTE_API_VERSION, "httproutes"):
        raise render.Unrealisable(
            "GatewayAPICRDMissing",
            f"spec.routing.inferencePool.gateway: the API server does not serve httproutes.{routing.ROUTE_API_VERSION}: "
            f"install the Gateway API CRDs and a Gateway implementation (docs/routing.md)", retryable=True)
    gw_ns = routing.gateway_namespace(pool, namespace)
    try:
        found = await client.get(routing.GATEWAY_API_VERSION, "gateways", gw_ns, gw.name)
    except kube.ApiError as exc:
        if exc.status != 403:
            raise
        raise render.Unrealisable(
            "GatewayUnreadable", f"spec.routing.inferencePool.gateway: cannot read Gateway {gw_ns}/{gw.name} "
                                 f"({exc.message}); the operator reads Gateways only in the namespaces it watches",
            retryable=True) from None
    if found is None:
        raise render.Unrealisable(
            "GatewayNotFound", f"spec.routing.inferencePool.gateway: Gateway {gw_ns}/{gw.name} not found",
            retryable=True)


def routing_status(spec: Any, name: str, namespace: str) -> dict[str, Any]:
    """status.routing for an InferenceService routed through its InferencePool."""
    pool = spec.routing.inference_pool
    out = {"inferencePool": name, "endpointPicker": routing.epp_name(name),
           "prefixCache": pool.endpoint_picker.prefix_cache}
    if pool.gateway is not None:
        out |= {"httpRoute": name, "gateway": f"{routing.gateway_namespace(pool, namespace)}/{pool.gateway.name}"}
    return out


def status_value(old: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.routing as the status merge patch must carry it: ``new``, with the keys of ``old`` it no longer
    has set to null (a merge patch merges nested objects; only a null removes a key)."""
    if new is None or not old:
        return new
    return {**{k: None for k in old if k not in new}, **new}


async def sync(client: kube.KubeClient, obj: dict[str, Any], spec: Any, children: routing.RoutingChildren | None,
               logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any] | None:
    """Apply (or remove) the routing objects of InferenceService ``obj``; returns its status.routing (None
    without routing). Raises render.Unrealisable (Degraded) or kube.ApiError."""
    meta = obj["metadata"]
    namespace, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid")
    if children is None:
        if (obj.get("status") or {}).get("routing"):
            for field, av, plural in routing.KINDS_DELETE_ORDER:
                await _delete_ours(client, field, av, plural, namespace, _name_of(field, name), uid, logger)
        return None
    await check_prerequisites(client, spec.routing.inference_pool, namespace)
    for field, av, plural in routing.KINDS:
        want = getattr(children, field)
        obj_name = _name_of(field, name)
        if want is None:
            await _delete_ours(client, field, av, plural, namespace, obj_name, uid, logger)
            continue
        have = await client.get(av, plural, namespace, obj_name)
        if have is not None and not (apply.controlled_by(have, uid) or apply.adoptable(have, render.OWNER_LABEL, name)):
            raise render.Unrealisable(
                "ChildConflict", f"{want['kind']} {namespace}/{obj_name} exists and is not controlled by this "
                                 f"InferenceService; delete or rename it", retryable=True)
        action, body = apply.plan(want, have)
        await child_write.write(client, logger, action, body, have, av, plural, namespace, obj_name, want["kind"],
                                label=field)
    return routing_status(spec, name, namespace)


def _name_of(field: str, name: str) -> str:
    """The InferencePool and HTTPRoute are named like the InferenceService, the endpoint picker's objects NAME-epp."""
    return name if field in ("inference_pool", "http_route") else routing.epp_name(name)


async def _delete_ours(client: kube.KubeClient, field: str, av: str, plural: str, namespace: str, obj_name: str,
                       uid: str | None, logger: logging.Logger | logging.LoggerAdapter) -> None:
    have = await client.get(av, plural, namespace, obj_name)
    if have is not None and apply.controlled_by(have, uid):  # routing no longer wanted
        await child_write.write(client, logger, "delete", None, have, av, plural, namespace, obj_name,
                                have.get("kind", plural), label=field)
