"""kopf glue of the autoscaler: one loop per InferenceService with ``spec.autoscaling.enabled``.

Each InferenceService gets a kopf *daemon* (not a fixed-interval timer: the loop sleeps
``metricsIntervalSeconds`` as the object says at that moment, so edits of the interval apply at the
next tick). One tick (``tick``):

1. read the Deployment the reconcile created (same name; skipped when absent or not controlled by
   this InferenceService) — its ``spec.replicas`` is the current size, its ``spec.selector`` finds
   the pods;
2. list the pods, classify them (Ready / starting / crashing; terminating pods are ignored) and
   scrape ``/metrics`` of every Ready pod concurrently at ``status.podIP`` and the port its
   container declares (``kvfleet_operator.scrape``);
3. ``kvfleet_operator.autoscale.decide`` (pure) with the in-memory history of this object;
4. on a change: merge-patch the Deployment's ``spec.replicas`` (never the InferenceService's spec,
   so GitOps tools see no drift) and post a Kubernetes Event "scaled 2→4: <reason>"; before a
   scale-down, first merge-patch every pod's ``controller.kubernetes.io/pod-deletion-cost``
   annotation from this tick's scrape (``kvfleet_operator.deletion_cost``: the idlest pods go
   first) — the only pod writes the operator makes;
5. write ``status.desiredReplicas`` and ``status.autoscaling`` (reason, message, lastScaleTime,
   observed figures) when they changed.

The history lives in the daemon: it starts empty when the operator (re)starts, when this replica
becomes the active peer, or when autoscaling is re-enabled — the policy then waits one scale-down
window before scaling down. kopf stops the daemon when the object is deleted, when autoscaling is
disabled (the ``when`` filter stops matching) and while another operator replica with a higher
peering priority is active, so only one replica ever scales. Pods are scraped without locks; the
apply step holds the reconcile's lock of the same object and drops the decision when the replicas
changed meanwhile (the next tick decides on fresh data), so neither overwrites the other.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import api, apply, handlers, kube
from . import status as st
from .autoscale import AutoscalingPolicy, Decision, History, PodObservation, decide
from .deletion_cost import ANNOTATION as DELETION_COST, deletion_costs
from .scrape import ScrapeTarget, pod_metrics_url, scrape_all

MAX_SCRAPE_TIMEOUT_SECONDS = 2.0
DEFAULT_INTERVAL_SECONDS = 15.0  # while the autoscaling spec is invalid
# Container waiting reasons that mean "broken", not "on its way".
BROKEN_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "Error", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


@dataclass
class AutoscalerState:
    """What one InferenceService's loop remembers between ticks (in memory only)."""

    history: History = field(default_factory=History)
    last_code: str | None = None
    clock: Callable[[], float] = time.monotonic


def _parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def _is_crashing(pod: Mapping[str, Any]) -> bool:
    """Not Ready and not on its way: failed, restarted, cannot start, or already started once.

    A container whose ``started`` is True has passed its startup probe (the rendered pods always
    have one); a pod that is unready after that is not capacity on the way (an overloaded or broken
    engine) and must not hold scale-ups for up to ``startupTimeoutSeconds``."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return True
    statuses = status.get("containerStatuses") or []
    if statuses and all(cs.get("started") is True for cs in statuses):
        return True
    for cs in status.get("containerStatuses") or []:
        if cs.get("ready"):
            continue
        state = cs.get("state") or {}
        if (cs.get("restartCount") or 0) > 0 or "terminated" in state:
            return True
        if (state.get("waiting") or {}).get("reason") in BROKEN_WAITING_REASONS:
            return True
    return False


def observe_pod(pod: Mapping[str, Any], now: datetime.datetime) -> PodObservation:
    """A Pod object as the policy sees it (metrics not yet filled in).

    age_seconds: since ``metadata.creationTimestamp`` (0 when absent)."""
    meta = pod.get("metadata") or {}
    created = _parse_time(meta.get("creationTimestamp"))
    age = max(0.0, (now - created).total_seconds()) if created else 0.0
    ready = _is_ready(pod)
    return PodObservation(name=meta.get("name", "?"), ready=ready, age_seconds=age,
                          crashing=not ready and _is_crashing(pod))


def _selected(pod: Mapping[str, Any], match_labels: Mapping[str, str]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in match_labels.items())


def _status_message(decision: Decision) -> str:
    if decision.changed:
        return f"scaled {decision.current_replicas}→{decision.desired_replicas}: {decision.reason}"
    return decision.reason


def _event(obj: Mapping[str, Any], type_: str, reason: str, message: str, now: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                     "namespace": meta.get("namespace") or "default"},
        "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": meta["name"],
                           "namespace": meta.get("namespace") or "default", "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": "kvfleet-operator"}, "reportingComponent": "kvfleet-operator",
        "reportingInstance": "kvfleet-operator", "action": "Scale",
        "firstTimestamp": now, "lastTimestamp": now, "eventTime": None, "count": 1,
    }


async def tick(obj: Mapping[str, Any], state: AutoscalerState, client: kube.KubeClient,
               logger: logging.Logger | logging.LoggerAdapter,
               scrape_timeout: float | None = None) -> Decision | None:
    """One autoscaling evaluation of InferenceService ``obj``; returns the Decision (None: skipped).

    Raises ValueError for an autoscaling spec the policy refuses (reported in status by the caller)
    and kube.ApiError for API failures (the next tick retries)."""
    meta = obj["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    policy = AutoscalingPolicy.from_spec(obj.get("spec") or {})
    timeout = scrape_timeout if scrape_timeout is not None else \
        min(MAX_SCRAPE_TIMEOUT_SECONDS, policy.metrics_interval_seconds / 2)

    dep = await client.get("apps/v1", "deployments", namespace, name)
    if dep is None or not apply.controlled_by(dep, meta.get("uid")):
        logger.debug(f"autoscaler: no Deployment {namespace}/{name} controlled by it yet")
        return None
    current = int((dep.get("spec") or {}).get("replicas", 1))
    match = ((dep.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(match.items()))
    pods = [p for p in await client.list("v1", "pods", namespace, label_selector=selector or None,
                                         not_older_than=kube.seen("pods"))
            if _selected(p, match) and not (p.get("metadata") or {}).get("deletionTimestamp")]

    wall = datetime.datetime.now(datetime.UTC)
    observed = [observe_pod(p, wall) for p in pods]
    urls = {o.name: pod_metrics_url(p) for o, p in zip(observed, pods) if o.ready}
    targets = [ScrapeTarget(n, u) for n, u in urls.items() if u is not None]
    results = {r.name: r for r in await scrape_all(targets, timeout=timeout)}
    for r in results.values():
        if r.error:
            logger.info(f"autoscaler: metrics of pod {r.name} unreadable: {r.error}")
    observed = [PodObservation(o.name, o.ready, o.age_seconds, o.crashing,
                               results[o.name].metrics if o.name in results else None)
                for o in observed]
    decision = decide(policy, current, observed, state.history, state.clock())

    # Apply under the reconcile's lock of this object, and only if nobody changed the replicas
    # while the pods were being scraped (else the next tick decides on fresh data).
    async with handlers.object_lock(namespace, name):
        if decision.changed:
            live = await client.get("apps/v1", "deployments", namespace, name)
            live_replicas = None if live is None else int((live.get("spec") or {}).get("replicas", 1))
            if live_replicas != current:
                logger.info(f"autoscaler: replicas changed to {live_replicas} during the tick; re-deciding next tick")
                return None
        state.history = decision.history
        now = st.now_rfc3339()
        message = _status_message(decision)
        if decision.changed:
            if decision.direction == "down":
                await _write_deletion_costs(client, namespace, pods, observed, logger)
            await client.patch("apps/v1", "deployments", namespace, name,
                               {"spec": {"replicas": decision.desired_replicas}})
            logger.info(f"autoscaler: {message}")
            reason = "ScaledUp" if decision.direction == "up" else "ScaledDown"
            await _post_event(client, obj, "Normal", reason, message, now, logger)
        elif decision.code == "MetricsUnavailable" and state.last_code != decision.code:
            await _post_event(client, obj, "Warning", decision.code, message, now, logger)
        state.last_code = decision.code

        readable = [o.metrics for o in observed if o.ready and o.metrics is not None]
        waiting = [m.num_requests_waiting for m in readable if m.num_requests_waiting is not None]
        running = [m.num_requests_running for m in readable if m.num_requests_running is not None]
        old_status = obj.get("status") or {}
        old_auto = old_status.get("autoscaling") or {}
        auto = {
            "reason": decision.code, "message": message[:32768],
            "kvCacheUsage": None if decision.kv_cache_usage is None else round(decision.kv_cache_usage, 3),
            "waitingRequests": sum(waiting) if waiting else None,
            "runningRequests": sum(running) if running else None,
            "scrapedPods": decision.readable,
            "recommendation": decision.recommendation,
            "lastScaleTime": now if decision.changed else old_auto.get("lastScaleTime"),
        }
        patch: dict[str, Any] = {}
        if old_status.get("desiredReplicas") != decision.desired_replicas:
            patch["desiredReplicas"] = decision.desired_replicas
        changed = {k: v for k, v in auto.items() if old_auto.get(k) != v}
        if changed:
            patch["autoscaling"] = changed
        if patch:
            await client.patch(api.API_VERSION, api.PLURAL, namespace, name, {"status": patch},
                               subresource="status")
        return decision


async def _write_deletion_costs(client: kube.KubeClient, namespace: str, pods: list[dict[str, Any]],
                                observed: list[PodObservation],
                                logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Set every pod's pod-deletion-cost annotation (only those whose value differs are patched).

    Best effort: a pod that is gone (404) or a failed patch is logged and the scale-down still
    proceeds (the ReplicaSet then falls back to its own ranking for that pod)."""
    costs = deletion_costs(observed)
    for pod, o in zip(pods, observed):
        value = str(costs[o.name])
        if ((pod.get("metadata") or {}).get("annotations") or {}).get(DELETION_COST) == value:
            continue
        try:
            await client.patch("v1", "pods", namespace, o.name,
                               {"metadata": {"annotations": {DELETION_COST: value}}})
        except kube.ApiError as exc:
            if exc.status != 404:
                logger.warning(f"autoscaler: could not set {DELETION_COST} on pod {o.name}: {exc}")


async def _post_event(client: kube.KubeClient, obj: Mapping[str, Any], type_: str, reason: str,
                      message: str, now: str, logger: logging.Logger | logging.LoggerAdapter) -> None:
    try:
        await client.create("v1", "events", obj["metadata"].get("namespace") or "default",
                            _event(obj, type_, reason, message, now))
    except kube.ApiError as exc:  # an Event is best effort; the status carries the same text
        logger.warning(f"autoscaler: could not post Event {reason}: {exc}")


async def _report_invalid(client: kube.KubeClient, obj: Mapping[str, Any], message: str) -> None:
    meta = obj["metadata"]
    old = (obj.get("status") or {}).get("autoscaling") or {}
    if old.get("reason") == "InvalidSpec" and old.get("message") == message:
        return
    await client.patch(api.API_VERSION, api.PLURAL, meta.get("namespace"), meta["name"],
                       {"status": {"autoscaling": {"reason": "InvalidSpec", "message": message[:32768]}}},
                       subresource="status")


def _enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="autoscaler", when=_enabled,
             cancellation_timeout=10.0)
async def autoscaler_daemon(body: kopf.Body, stopped: kopf.DaemonStopped, logger: logging.Logger,
                            **_: Any) -> None:
    """The per-InferenceService autoscaling loop (see the module docstring)."""
    state = AutoscalerState()
    client = kube.get_client()
    logger.info("autoscaler: started (history empty; scale-down waits one window)")
    while not stopped:
        obj = handlers.plain_copy(body)  # the live body kopf keeps up to date, copied for this tick
        try:
            interval = AutoscalingPolicy.from_spec(obj.get("spec") or {}).metrics_interval_seconds
        except ValueError as exc:  # only the spec: other errors are not reported as InvalidSpec
            logger.error(f"autoscaler: invalid autoscaling spec: {exc}")
            try:
                await _report_invalid(client, obj, str(exc))
            except kube.ApiError as api_exc:
                logger.warning(f"autoscaler: status write failed: {api_exc}")
            await stopped.wait(DEFAULT_INTERVAL_SECONDS)
            continue
        try:
            await tick(obj, state, client, logger)
        except kube.ApiError as exc:
            logger.warning(f"autoscaler: API error, retrying next tick: {exc}")
        except Exception:  # noqa: BLE001 - an unexpected object shape: log it, keep the loop and its history
            logger.exception("autoscaler: tick failed, retrying next tick")
        await stopped.wait(max(1.0, interval))
    logger.info(f"autoscaler: stopped ({stopped.reason})")
