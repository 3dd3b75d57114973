"""Pure status computation: conditions Ready / Progressing / Degraded and the replica fields.

``set_condition`` upserts one condition, keeping lastTransitionTime when the status does not
change and keeping condition types owned by other controllers (the autoscaler may use it too).
``compute_status`` derives the status the reconcile writes from the live Deployment.
Conditions follow the Kubernetes convention (type, status, reason, message, lastTransitionTime,
observedGeneration) so `kubectl wait --for=condition=Ready` and Argo CD health checks read them.
"""
from __future__ import annotations

import copy
import datetime
from typing import Any

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


def now_rfc3339() -> str:
    """Current UTC time as RFC 3339 with a Z suffix (the API's time format)."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool | str, reason: str, message: str,
                  now: str, observed_generation: int | None = None) -> list[dict[str, Any]]:
    """Return a new list with condition ``type_`` set; lastTransitionTime changes only on a status flip."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    out = [copy.deepcopy(c) for c in conditions]
    old = next((c for c in out if c.get("type") == type_), None)
    new = {"type": type_, "status": value, "reason": reason, "message": message,
           "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == value
           and old.get("lastTransitionTime") else now}
    if observed_generation is not None:
        new["observedGeneration"] = observed_generation
    if old is None:
        out.append(new)
    else:
        out[out.index(old)] = new
    return out


def get_condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The condition of ``type_`` in a status dict, or None."""
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), None)


def rollout(deployment: dict[str, Any] | None, desired: int,
            template_written: bool = True) -> tuple[bool, bool, str, str]:
    """(ready, progressing, reason, message) of the live Deployment for ``desired`` replicas.

    Ready: the Deployment controller has seen the current template, no pod of an older template is
    left, and at least one pod is ready (``desired`` 0 is never Ready). Progressing: a rollout or a
    scale-up is still under way. ``template_written``: this reconcile created the Deployment or
    patched its pod template; when it did not, a change the controller has not observed yet is
    most likely a replica change (e.g. the autoscaler's), which leaves the serving pods as they
    are — Ready is then judged from the pod counts (reason ``Updating``; ``compute_status`` also
    keeps a previous Ready=False) instead of flapping to False on every scale."""
    if deployment is None:
        return False, True, "Creating", "Deployment is being created"
    st = deployment.get("status") or {}
    gen = (deployment.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    replicas, updated = st.get("replicas") or 0, st.get("updatedReplicas") or 0
    ready = st.get("readyReplicas") or 0
    for cond in st.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return ready > 0, False, "ProgressDeadlineExceeded", cond.get("message") or "rollout stuck"
    if desired == 0:
        return False, False, "ScaledToZero", "spec asks for 0 replicas"
    if gen is not None and (observed is None or observed < gen):
        if template_written:
            return False, True, "RollingOut", "Deployment controller has not seen the new template yet"
        return ready > 0 and replicas <= updated, True, "Updating", \
            "Deployment controller has not seen the latest change (e.g. a replica count) yet"
    if updated < desired or replicas > updated:
        return ready > 0 and replicas <= updated, True, "RollingOut", \
            f"{updated} of {desired} pods run the current template ({replicas} pods in total)"
    if ready < desired:
        return ready > 0, True, "WaitingForPods" if ready == 0 else "ScalingUp", \
            f"{ready} of {desired} pods ready (loading the model can take up to the startup timeout)"
    return True, False, "Available", f"{ready} of {desired} pods ready"


def compute_status(obj: dict[str, Any], deployment: dict[str, Any] | None, desired: int, url: str,
                   model: dict[str, Any], selector: str, now: str, autoscaling: bool,
                   template_written: bool = True, pod_problem: tuple[str, str] | None = None) -> dict[str, Any]:
    """The status the reconcile owns, given the live Deployment after apply (``template_written``:
    see ``rollout``), status.model (``weights.model_status``) and the serving pods' or the model
    download's failure (reason, message), if any.

    A failing pod makes Degraded=True with its reason and message at once (Ready and Progressing
    keep the rollout's view: old pods may still serve); the condition clears when no pod fails.
    desiredReplicas is written only when autoscaling is off (the autoscaler owns it otherwise)."""
    old = obj.get("status") or {}
    gen = (obj.get("metadata") or {}).get("generation")
    is_ready, progressing, reason, message = rollout(deployment, desired, template_written)
    if reason == "Updating":  # not yet observed: never turn Ready on (a template patch may be under way)
        is_ready = is_ready and (get_condition(old, READY) or {}).get("status") == "True"
    conds = old.get("conditions") or []
    conds = set_condition(conds, READY, is_ready, reason, message, now, gen)
    conds = set_condition(conds, PROGRESSING, progressing, reason, message, now, gen)
    degraded = reason == "ProgressDeadlineExceeded"
    d_reason, d_message = (reason, message) if degraded else ("ReconcileSucceeded", "children match the spec")
    if pod_problem is not None:
        degraded, (d_reason, d_message) = True, pod_problem
    conds = set_condition(conds, DEGRADED, degraded, d_reason, d_message, now, gen)
    st = (deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "conditions": conds,
        "replicas": st.get("replicas") or 0,
        "readyReplicas": st.get("readyReplicas") or 0,
        "updatedReplicas": st.get("updatedReplicas") or 0,
        "selector": selector,
        "url": url,
        "model": model,
    }
    if not autoscaling or old.get("desiredReplicas") is None:
        status["desiredReplicas"] = desired
    return status


def degraded_status(obj: dict[str, Any], reason: str, message: str, now: str) -> dict[str, Any]:
    """Status for a spec that cannot be realised: Degraded=True, Ready/Progressing False."""
    old = obj.get("status") or {}
    gen = (obj.get("metadata") or {}).get("generation")
    conds = old.get("conditions") or []
    conds = set_condition(conds, DEGRADED, True, reason, message, now, gen)
    conds = set_condition(conds, PROGRESSING, False, reason, "reconcile stopped until the spec changes", now, gen)
    ready = get_condition(old, READY)
    if ready is None or ready.get("status") != "True":  # children (if any) keep serving the old spec
        conds = set_condition(conds, READY, False, reason, message, now, gen)
    return {"observedGeneration": gen, "conditions": conds}


def status_patch(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``new`` whose values differ from ``old`` (empty: nothing to write)."""
    old = old or {}
    return {k: v for k, v in new.items() if old.get(k) != v}
