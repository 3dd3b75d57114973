"""Peering so that several operator replicas never act at once (kopf peering, newest pod wins).

kopf peering: every operator writes a keep-alive (identity, priority, lifetime) into a
ClusterKopfPeering (cluster-wide mode) or KopfPeering (per namespace) object; an operator that sees
a live peer with a higher priority pauses; peers with the *same* priority all pause (kopf's rule),
which would freeze a rolling update of the operator. So each operator takes as priority its start
time in milliseconds: during a rolling update the new pod has the higher priority, the old one pauses
at once and exits when Kubernetes stops it — one acts at any time and none freezes. A crashed peer
stops counting after its lifetime (60 s). ``kvfleet-operator run --standalone`` disables peering.

The peering CRDs (kopf.dev/v1) are generated here and shipped in crds/ with the InferenceService CRD;
the operator creates its peering object at startup when it is missing.
"""
from __future__ import annotations

import time
from typing import Any

import kopf

from . import kube

DEFAULT_NAME = "kvfleet"
GROUP, VERSION = "kopf.dev", "v1"
namespaces: list[str] = []  # set by the CLI in namespaced mode


def start_priority(now: float | None = None) -> int:
    """Peering priority of an operator started at ``now`` (epoch seconds): milliseconds, newer = higher."""
    return int((time.time() if now is None else now) * 1000)


def _crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kvfleet"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "scope": scope,
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "kopf peering: keep-alives of the operators watching the same resources.",
                    "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }},
            }],
        },
    }


def peering_crds() -> list[dict[str, Any]]:
    """ClusterKopfPeering and KopfPeering CRDs (kopf.dev/v1)."""
    return [_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            _crd("KopfPeering", "kopfpeerings", "Namespaced")]


async def ensure_peering_objects(settings: kopf.OperatorSettings) -> list[str]:
    """Create the peering object(s) the operator keeps alive, if missing. Returns what was created."""
    if settings.peering.standalone:
        return []
    client = kube.get_client()
    name = settings.peering.name
    created = []
    targets: list[tuple[str, str | None]] = [("clusterkopfpeerings", None)] if settings.peering.clusterwide \
        else [("kopfpeerings", ns) for ns in namespaces]
    for plural, ns in targets:
        if await client.get(f"{GROUP}/{VERSION}", plural, ns, name) is None:
            kind = "ClusterKopfPeering" if ns is None else "KopfPeering"
            meta: dict[str, Any] = {"name": name, **({"namespace": ns} if ns else {})}
            try:
                await client.create(f"{GROUP}/{VERSION}", plural, ns,
                                    {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": meta})
                created.append(f"{plural}/{ns + '/' if ns else ''}{name}")
            except kube.ApiError as exc:
                if exc.status != 409:
                    raise
    return created
