"""Pure status computation: conditions Ready / Progressing / Degraded and the replica fields.

``set_condition`` upserts one condition, keeping lastTransitionTime when the status does not
change and keeping condition types owned by other controllers (the autoscaler may use it too).
``compute_status`` derives the status the reconcile writes from one fresh read of the
InferenceService and of its Deployment (the reconcile makes both reads under the object's lock).
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
            serving: bool = False) -> tuple[bool, bool, str, str]:
    """(ready, progressing, reason, message) of the live Deployment for ``desired`` replicas.

    ``serving``: this generation of the InferenceService was already reported Ready and this pass did
    not write the pod template. Then a change the Deployment controller has not observed yet (a
    replica count: the autoscaler's), a scale-up, a lost pod or a stuck progress deadline keep Ready
    as long as a pod of the current template is ready and no older one is left (reason ``Updating``
    while unobserved) — no flapping on every scale. Otherwise (a new generation, a template written,
    the first rollout) Ready needs the rollout finished: the controller has observed the
    Deployment's generation (``status.observedGeneration >= metadata.generation``), every pod runs
    the current template (updatedReplicas reaches ``desired``, no older pod left), and
    readyReplicas and availableReplicas reach ``desired``. ``desired`` 0 is never Ready."""
    if deployment is None:
        return False, True, "Creating", "Deployment is being created"
    st = deployment.get("status") or {}
    gen = (deployment.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    replicas, updated = st.get("replicas") or 0, st.get("updatedReplicas") or 0
    ready, available = st.get("readyReplicas") or 0, st.get("availableReplicas") or 0
    current_pods_serve = serving and ready > 0 and replicas <= updated
    for cond in st.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return current_pods_serve, False, "ProgressDeadlineExceeded", cond.get("message") or "rollout stuck"
    if desired == 0:
        return False, False, "ScaledToZero", "spec asks for 0 replicas"
    if gen is not None and (observed is None or observed < gen):
        if serving:
            return current_pods_serve, True, "Updating", \
                "Deployment controller has not seen the latest change (e.g. a replica count) yet"
        return False, True, "RollingOut", \
            f"Deployment controller has not seen generation {gen} yet (observed: {observed})"
    if updated < desired or replicas > updated:
        return current_pods_serve, True, "RollingOut", \
            f"{updated} of {desired} pods run the current template ({replicas} pods in total)"
    if ready < desired or available < desired:
        return serving and ready > 0, True, "WaitingForPods" if ready == 0 else "ScalingUp", \
            (f"{ready} of {desired} pods ready, {available} available "
             f"(loading the model can take up to the startup timeout)")
    return True, False, "Available", f"{ready} of {desired} pods ready"


def replica_failure(deployment: dict[str, Any] | None) -> tuple[str, str] | None:
    """(reason, message) of the Deployment's ``ReplicaFailure`` condition when True, else None.

    The Deployment controller copies it from the ReplicaSet that cannot create its pods: reason
    ``FailedCreate`` with the API server's refusal, e.g. 'pods "x-7d9f-abcde" is forbidden: exceeded
    quota: gpu-quota, requested: requests.nvidia.com/gpu=4, ...', an admission webhook's denial or a
    Pod Security violation. No pod exists to report it, so only the Deployment tells."""
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason") or "ReplicaFailure", cond.get("message") or "the ReplicaSet cannot create pods"
    return None


def compute_status(obj: dict[str, Any], deployment: dict[str, Any] | None, desired: int, url: str,
                   model: dict[str, Any], selector: str, now: str, autoscaling: bool,
                   template_written: bool = True, problem: tuple[str, str] | None = None) -> dict[str, Any]:
    """The status the reconcile owns, from one fresh read of the InferenceService ``obj`` (its
    status as last written) and of the live Deployment after apply (``template_written``: this pass
    created the Deployment or patched its pod template; see ``rollout``), and status.model
    (``weights.model_status``).

    ``problem`` (reason, message): a child the API server would not create or update
    (``ChildCreateFailed``/``ChildUpdateFailed``), a serving pod's failure (``pods.pod_problem``) or the
    model download's.
    Degraded=True takes, in this order: ``problem``, the Deployment's ReplicaFailure (``FailedCreate``:
    quota, admission), ProgressDeadlineExceeded; Ready and Progressing keep the rollout's view (old
    pods may still serve). The condition clears when none holds. desiredReplicas is written only when
    autoscaling is off (the autoscaler owns it otherwise)."""
    old = obj.get("status") or {}
    gen = (obj.get("metadata") or {}).get("generation")
    old_ready = get_condition(old, READY) or {}
    serving = not template_written and old_ready.get("status") == "True" \
        and old_ready.get("observedGeneration") == gen
    is_ready, progressing, reason, message = rollout(deployment, desired, serving)
    conds = old.get("conditions") or []
    conds = set_condition(conds, READY, is_ready, reason, message, now, gen)
    conds = set_condition(conds, PROGRESSING, progressing, reason, message, now, gen)
    stuck = (reason, message) if reason == "ProgressDeadlineExceeded" else None
    cause = problem or replica_failure(deployment) or stuck
    d_reason, d_message = cause or ("ReconcileSucceeded", "children match the spec")
    conds = set_condition(conds, DEGRADED, cause is not None, d_reason, d_message, now, gen)
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
