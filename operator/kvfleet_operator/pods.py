"""Pure: why an InferenceService's serving pods fail, from the pods' own status and their Warning
Events (no I/O).

``pod_problem(pods, events)`` returns the most telling failure among the pods as ``(reason, message)``, or
None when none is failing. The reconcile reports it as ``Degraded=True`` at once, instead of waiting
for the Deployment's progress deadline (startup timeout + 600 s) while the status says the model is
loading. Reasons, most specific first:

- ``OOMKilled``: a container's last termination was the kernel's OOM kill (memory limit too low);
- ``CrashLoopBackOff``: a container keeps exiting; the message carries its exit code and the last line
  of its termination message (the pods render ``terminationMessagePolicy: FallbackToLogsOnError``, so
  that is the server's last log line, e.g. "error: not supported yet: ...");
- ``ImagePullBackOff`` / ``ErrImagePull`` / ``InvalidImageName``: the serving image cannot be pulled;
- ``CreateContainerConfigError`` / ``CreateContainerError``: e.g. a missing Secret for HF_TOKEN;
- ``FailedAttachVolume`` / ``FailedMount``: a scheduled pod cannot start because a volume does not
  attach or mount, e.g. "Multi-Attach error for volume "pvc-…" Volume is already used by pod(s) …"
  (a ReadWriteOnce model cache on a second node) or a missing PVC/Secret. Only the kubelet's and the
  attach/detach controller's Warning Events say so (the pod itself just waits in ContainerCreating):
  the reconcile reads the Events of the pods ``starting_pods`` names (``event_selector``);
- ``Unschedulable``: no node fits (e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu").

Init containers (the hf:// model download) are judged like the server container. Pods being deleted
and pods that finished are ignored; volume Events count only while their pod is still Pending.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PULL_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName")
CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError")
VOLUME_REASONS = ("FailedAttachVolume", "FailedMount")  # Warning Event reasons (attach/detach controller, kubelet)
REASONS = ("OOMKilled", "CrashLoopBackOff", *PULL_REASONS, *CONFIG_REASONS, *VOLUME_REASONS, "Unschedulable")
MAX_DETAIL = 512  # characters of a termination message kept in the condition


def _last_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][-MAX_DETAIL:] if lines else ""


def _container_problem(pod: str, cs: dict[str, Any], init: bool) -> tuple[str, str] | None:
    what = f"pod {pod}: {'init container' if init else 'container'} {cs.get('name')}"
    state, last = cs.get("state") or {}, cs.get("lastState") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or last.get("terminated") or {}
    restarts = cs.get("restartCount") or 0
    if terminated.get("reason") == "OOMKilled" and (waiting or state.get("terminated")):
        return "OOMKilled", f"{what} was OOMKilled ({restarts} restarts): raise spec.resources.memory"
    if waiting.get("reason") == "CrashLoopBackOff":
        detail = _last_line(terminated.get("message")) or terminated.get("reason") or "no termination message"
        code = terminated.get("exitCode")
        return "CrashLoopBackOff", (f"{what} is crash-looping ({restarts} restarts, last exit code {code}): "
                                    f"{detail}")
    if waiting.get("reason") in PULL_REASONS + CONFIG_REASONS:
        return waiting["reason"], f"{what}: {waiting.get('message') or waiting['reason']}"
    return None


def _live(pod: dict[str, Any]) -> bool:
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    return not meta.get("deletionTimestamp") and st.get("phase") not in ("Succeeded", "Failed")


def is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def adapter_counts(names: Sequence[str], pods: list[dict[str, Any]], annotation: str) -> list[dict[str, Any]]:
    """status.adapters: for each adapter name, the live Ready pods whose ``annotation`` (the comma-separated
    adapters its server was started with) lists it; pods of an older template without it do not count."""
    served = [set(filter(None, (((p.get("metadata") or {}).get("annotations") or {}).get(annotation) or "")
                             .split(","))) for p in pods if _live(p) and is_ready(p)]
    return [{"name": n, "readyReplicas": sum(n in s for s in served)} for n in names]


def starting_pods(pods: list[dict[str, Any]]) -> list[str]:
    """Names of the pods that are scheduled but still Pending: the ones whose Warning Events may say
    why they do not start (a volume that does not attach or mount)."""
    return [(p.get("metadata") or {}).get("name", "?") for p in pods if _live(p)
            and (p.get("status") or {}).get("phase") == "Pending"
            and any(c.get("type") == "PodScheduled" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or [])]


def event_selector(pod_name: str) -> str:
    """The field selector of a pod's Warning Events (core/v1 ``events`` list)."""
    return f"involvedObject.kind=Pod,involvedObject.name={pod_name},type=Warning"


def pod_problem(pods: list[dict[str, Any]], events: Sequence[dict[str, Any]] = ()) -> tuple[str, str] | None:
    """(reason, message) of the most specific failure among ``pods`` (order of ``REASONS``), or None.

    ``events``: core/v1 Events about the pods; those with a ``VOLUME_REASONS`` reason about a pod that
    ``starting_pods`` names count, with the Event's message (the first of several about one pod
    suffices: the kubelet repeats them)."""
    found: list[tuple[str, str]] = []
    for pod in pods:
        if not _live(pod):
            continue
        name, st = (pod.get("metadata") or {}).get("name", "?"), pod.get("status") or {}
        for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
            for cs in st.get(key) or []:
                problem = _container_problem(name, cs, init)
                if problem is not None:
                    found.append(problem)
        for cond in st.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                found.append(("Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message') or ''}".strip()))
    starting = set(starting_pods(pods))
    for event in events:
        ref = event.get("involvedObject") or {}
        if event.get("reason") in VOLUME_REASONS and ref.get("kind") == "Pod" and ref.get("name") in starting:
            detail = " ".join((event.get("message") or event["reason"]).split())[:MAX_DETAIL]
            found.append((event["reason"], f"pod {ref['name']}: {detail}"))
    if not found:
        return None
    return min(found, key=lambda p: REASONS.index(p[0]))
