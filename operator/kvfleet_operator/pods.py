"""Pure: why an InferenceService's serving pods fail, from the pods' own status (no I/O).

``pod_problem(pods)`` returns the most telling failure among the pods as ``(reason, message)``, or
None when none is failing. The reconcile reports it as ``Degraded=True`` at once, instead of waiting
for the Deployment's progress deadline (startup timeout + 600 s) while the status says the model is
loading. Reasons, most specific first:

- ``OOMKilled``: a container's last termination was the kernel's OOM kill (memory limit too low);
- ``CrashLoopBackOff``: a container keeps exiting; the message carries its exit code and the last line
  of its termination message (the pods render ``terminationMessagePolicy: FallbackToLogsOnError``, so
  that is the server's last log line, e.g. "error: not supported yet: ...");
- ``ImagePullBackOff`` / ``ErrImagePull`` / ``InvalidImageName``: the serving image cannot be pulled;
- ``CreateContainerConfigError`` / ``CreateContainerError``: e.g. a missing Secret for HF_TOKEN;
- ``Unschedulable``: no node fits (e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu").

Init containers (the hf:// model download) are judged like the server container. Pods being deleted
and pods that finished are ignored.
"""
from __future__ import annotations

from typing import Any

PULL_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName")
CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError")
REASONS = ("OOMKilled", "CrashLoopBackOff", *PULL_REASONS, *CONFIG_REASONS, "Unschedulable")
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


def pod_problem(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) of the most specific failure among ``pods`` (order of ``REASONS``), or None."""
    found: list[tuple[str, str]] = []
    for pod in pods:
        meta, st = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or st.get("phase") in ("Succeeded", "Failed"):
            continue
        name = meta.get("name", "?")
        for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
            for cs in st.get(key) or []:
                problem = _container_problem(name, cs, init)
                if problem is not None:
                    found.append(problem)
        for cond in st.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                found.append(("Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message') or ''}".strip()))
    if not found:
        return None
    return min(found, key=lambda p: REASONS.index(p[0]))
