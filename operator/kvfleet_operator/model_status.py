"""Pure: where a cold start is — the ModelReady condition and download failures, from the objects' status.

``ModelReady`` (status.conditions) moves through

- ``False / Downloading`` — a download Job (shared cache) or a pod's model-download init container
  (per-pod caches) is fetching: the message gives bytes done and bytes total per source, read from
  the downloader's progress gauges (``kvfleet_server.download``);
- ``False / Loading`` — the weights are in place and the server is starting: the message names the
  start-up phase of the pods not ready yet (waiting for a node, pulling the image, loading the model
  until /health answers 200);
- ``True / Ready`` — at least one pod of the current template serves the pinned revision;

or ``False`` with the reason of a failed download (``download_problem``), which also makes the
InferenceService Degraded. Reasons come from the downloader's last line (``error: REASON: MESSAGE``)
and name the field to fix: the uri for RepositoryNotFound, RevisionNotFound, BucketNotFound,
FileNotFound, NothingToServe and ObjectsChanged; spec.model.credentialsSecret for Unauthorized; the
cache size for DiskFull.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from . import api
from .model_source import Source
from .pods import is_ready

MODEL_READY = "ModelReady"
_ERROR_LINE = re.compile(r"^error: (?P<reason>[A-Za-z]+): (?P<message>.*)$")


@dataclass(frozen=True)
class Download:
    """One download: its source and pinned revision, ``state`` (pending, running, succeeded, failed),
    ``where`` (Job or pod name), the progress gauges when read (bytes), and the downloader's last line."""
    source: Source
    revision: str
    state: str
    where: str
    downloaded: float | None = None
    expected: float | None = None
    last_line: str | None = None


def human_bytes(n: float) -> str:
    """Bytes in binary units, as Kubernetes quantities read: 1.5 GiB, 340.0 MiB, 12 B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def cache_field(spec: api.InferenceServiceSpec) -> str:
    """The field that sizes the model cache (named by DiskFull)."""
    cache = spec.model_cache
    if cache.shared:
        return "spec.modelCache.shared.size"
    if cache.persistent_volume_claim:
        return "spec.modelCache.persistentVolumeClaim"
    return "spec.modelCache.emptyDir.sizeLimit"


def failure(line: str | None, source: Source, spec: api.InferenceServiceSpec) -> tuple[str, str] | None:
    """(reason, message naming the field to fix) of a downloader's ``error: REASON: MESSAGE`` line."""
    m = _ERROR_LINE.match((line or "").strip())
    if m is None:
        return None
    reason, message = m["reason"], m["message"]
    where = "spec.model.credentialsSecret" if reason == "Unauthorized" else \
        cache_field(spec) if reason == "DiskFull" else source.field
    return reason, f"{where}: {message}"


def last_line(text: str | None) -> str | None:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else None


def termination_line(pod: dict[str, Any], container: str) -> str | None:
    """The last line of ``container``'s termination message (state or lastState) in a pod."""
    st = pod.get("status") or {}
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        if cs.get("name") == container:
            for key in ("state", "lastState"):
                term = (cs.get(key) or {}).get("terminated") or {}
                if term.get("exitCode") not in (None, 0):
                    return last_line(term.get("message"))
    return None


def download_problem(downloads: list[Download], spec: api.InferenceServiceSpec) -> tuple[str, str] | None:
    """(reason, message) of the first failed download, or None. A failure without the downloader's
    line (e.g. the pod could not start) is ``DownloadFailed``."""
    for d in downloads:
        if d.state == "failed":
            return failure(d.last_line, d.source, spec) or (
                "DownloadFailed", f"{d.source.field}: downloading {d.source.uri} failed ({d.where}): "
                                  f"{d.last_line or 'no error message'}")
    return None


def _progress(d: Download) -> str:
    what = f"{d.source.uri}@{d.revision[:12]}"
    if d.downloaded is not None and d.expected:
        pct = min(100.0, 100.0 * d.downloaded / d.expected)
        return f"{what}: {human_bytes(d.downloaded)} of {human_bytes(d.expected)} ({pct:.0f}%)"
    if d.downloaded is not None:
        return f"{what}: {human_bytes(d.downloaded)} so far (listing the files)"
    return f"{what}: {d.where} starting"


def pod_phase(pod: dict[str, Any]) -> str:
    """The start-up phase of a serving pod that is not ready, in words."""
    name = (pod.get("metadata") or {}).get("name", "?")
    st = pod.get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"pod {name}: waiting for a node ({cond.get('reason') or 'Pending'})"
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return f"pod {name}: {waiting.get('reason') or 'waiting'}"
        running = (cs.get("state") or {}).get("running")
        if running is not None and not cs.get("ready"):
            since = f" since {running['startedAt']}" if running.get("startedAt") else ""
            return f"pod {name}: loading the model{since} (/health not yet 200)"
    return f"pod {name}: {st.get('phase') or 'Pending'}"


def condition(downloads: list[Download], serving_pods: list[dict[str, Any]], ready: bool,
              revision: str | None, per_pod: bool = False) -> tuple[bool, str, str]:
    """(status, reason, message) of ModelReady. ``downloads``: the current generation's; ``ready``: the
    rollout judged Ready (a pod of the current template serves); ``revision``: the pinned revision of
    spec.model.uri (None if not downloaded); ``per_pod``: each pod downloads in its init container (so
    before a pod runs one, nothing is "in place")."""
    failed = [d for d in downloads if d.state == "failed"]
    if failed:
        return False, "DownloadFailed", "; ".join(f"{d.source.uri}@{d.revision[:12]}: {d.last_line or d.where}"
                                                  for d in failed)
    busy = [d for d in downloads if d.state in ("pending", "running")]
    if busy:
        return False, "Downloading", "; ".join(_progress(d) for d in busy)
    at = f" at {revision[:12]}" if revision else ""
    if ready:
        return True, "Ready", f"the model{at} is served"
    starting = [pod_phase(p) for p in serving_pods if not is_ready(p)]
    detail = "; ".join(starting[:3]) if starting else "waiting for pods"
    if per_pod:
        return False, "Loading", f"each pod downloads the weights{at} in its init container, then loads them; {detail}"
    return False, "Loading", f"weights in place{at}; {detail}"
