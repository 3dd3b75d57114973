"""What this process knows of each InferenceService's Deployment, Service and PodDisruptionBudget (the
children named after it): which exist, the newest resourceVersion the watch delivered, and the newest
one a reconcile pass read or wrote. In memory only, no I/O; a restart starts empty and is correct, only
slower (every child is read again).

This is client-go's informer bookkeeping and ControllerExpectations, cut to what a pass needs:

- A watch event of a version a pass already read or wrote (the echo of the operator's own create or
  patch, or an event delivered while the pass was reading that version) carries nothing new: no pass.
- A child that no pass and no watch event has seen is not read before it is created: the first pass of
  a new InferenceService creates its children without three GETs that answer 404. A create answered
  409 (the object exists after all: the watch lags, or it is somebody else's) marks it known, and the
  pass starts again, reading it (``handlers.reconcile``).
- A child that is not wanted (the PDB of a one-replica service) and is not known to exist is not read.
- Whether the status this process last wrote names a pod failure: a healthy pod's event then needs no
  read of the InferenceService to know that it changes nothing (``pod_failure_reported``; dropped when
  the watch shows a status somebody else wrote).

resourceVersions are compared as numbers (the API server's are etcd revisions, as ``kube.revision``);
a version that is not a number is always news. Entries are dropped when a pass finds the child absent,
when the InferenceService is gone, and when the watch reports the child deleted.
"""
from __future__ import annotations

import dataclasses

from . import kube


@dataclasses.dataclass
class _Child:
    latest: int = 0  # newest resourceVersion delivered by the watch or seen by a pass
    used: int = 0  # newest resourceVersion a reconcile pass read or wrote (its status reflects it)
    deleted: bool = False  # the watch reported it deleted after a pass last saw it


_children: dict[tuple[str, str, str], _Child] = {}
_pod_failure: dict[tuple[str, str], bool] = {}  # (namespace, owner) -> the last pass's Degraded names a pod


def watched(namespace: str, owner: str, plural: str, resource_version: str | None, deleted: bool) -> bool:
    """Record a watch event of child ``plural`` of ``namespace/owner``; True when a pass must follow
    (the event is newer than what a pass has seen, a deletion, or has no numeric version)."""
    rv = kube.revision(resource_version)
    child = _children.setdefault((namespace, owner, plural), _Child())
    child.latest = max(child.latest, rv)
    if deleted:
        child.deleted = True
        return True
    return rv == 0 or rv > child.used


def pending(namespace: str, owner: str, plurals: tuple[str, ...]) -> bool:
    """Whether a watch event of one of ``plurals`` is not yet accounted for by a completed pass (a pass
    queued behind one that has since read that version has nothing new to read)."""
    for plural in plurals:
        child = _children.get((namespace, owner, plural))
        if child is not None and (child.deleted or child.latest > child.used):
            return True
    return False


def known(namespace: str, owner: str, plural: str) -> bool:
    """Whether the child may exist: a pass or the watch has seen it, or the API server said so."""
    return (namespace, owner, plural) in _children


def seen(namespace: str, owner: str, plural: str, obj: dict | None) -> None:
    """A pass read or wrote the child (``obj`` as the API server answered; {} when only its existence is
    known, a create answered 409) or found it absent (None: forgotten)."""
    key = (namespace, owner, plural)
    if obj is None:
        _children.pop(key, None)
        return
    child = _children.setdefault(key, _Child())
    child.latest = max(child.latest, kube.revision((obj.get("metadata") or {}).get("resourceVersion")))


def accounted(namespace: str, owner: str, children: dict[str, dict | None]) -> None:
    """A pass completed (its status written) from these children (plural -> object, None when absent):
    their watch events up to these versions are not news any more."""
    for plural, obj in children.items():
        seen(namespace, owner, plural, obj)
        if obj is not None:  # the version it read, not the newest the watch has since delivered
            child = _children[(namespace, owner, plural)]
            child.used = max(child.used, kube.revision((obj.get("metadata") or {}).get("resourceVersion")))
            child.deleted = False


def reported(namespace: str, owner: str, pod_failure: bool | None) -> None:
    """The InferenceService's status as this process wrote it is Degraded by a pod failure
    (``pods.REASONS``) or not; None: unknown (a status write is under way or failed)."""
    if pod_failure is None:
        _pod_failure.pop((namespace, owner), None)
    else:
        _pod_failure[(namespace, owner)] = pod_failure


def pod_failure_reported(namespace: str, owner: str) -> bool | None:
    """Whether the status this process last wrote names a pod failure; None when it wrote none since
    it started, the last write failed, or the watch showed a status that says otherwise (somebody else
    wrote it): read the status to know."""
    return _pod_failure.get((namespace, owner))


def forget(namespace: str, owner: str, plurals: tuple[str, ...]) -> None:
    """The InferenceService is gone: drop what is known of its children and its status."""
    _pod_failure.pop((namespace, owner), None)
    for plural in plurals:
        _children.pop((namespace, owner, plural), None)

