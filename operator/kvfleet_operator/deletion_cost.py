"""Pure: which pods a scale-down should remove first, as ``pod-deletion-cost`` annotation values.

When a Deployment's replicas drop by k, its ReplicaSet controller deletes k pods, ranked (Kubernetes
``pkg/controller/controller_utils.go``, ``ActivePodsWithRanks``): unscheduled before scheduled,
Pending before Running, not Ready before Ready, then the lower
``controller.kubernetes.io/pod-deletion-cost`` annotation first (beta and on by default since
Kubernetes 1.22; an absent annotation is 0), then pods Ready for less time, more restarts, newer.
Left alone it picks among Ready pods by age — often a pod with streams in flight and a warm prefix
cache while an idle one lives on. Before it lowers the replicas, the autoscaler writes these costs
on every pod of the Deployment from this tick's scrape, so the idlest pods go first:

* Ready pods are ranked by their load, ``vllm:num_requests_running + vllm:num_requests_waiting``
  (a removed pod's running requests must finish or be cut at the drain timeout; its waiting ones
  are retried elsewhere), ties broken by fewer cached KV blocks (``kvfleet:kv_cache_blocks_cached``:
  the prefix cache lost with the pod; a server without that gauge — vLLM — is compared by
  ``vllm:kv_cache_usage_perc``), then by name (deterministic). The least loaded gets cost 1, the
  next 2, and so on.
* A Ready pod whose scrape failed this tick is ranked as if it carried the mean load of the scraped
  pods — the same assumption ``autoscale.decide`` makes — so a cost written while it was busy is
  never left standing, and a pod that may be overloaded (its /metrics timed out) is not the first
  to go either.
* Pods that are not Ready (starting, crash-looping) get cost 0, the lowest (the ReplicaSet removes
  them first anyway).

Costs are ranks, recomputed from scratch at every scale-down (refreshed, never accumulated): the
values stay between 0 and the number of pods, far inside the annotation's int32 range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .autoscale import PodMetrics, PodObservation

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"


def _load(m: PodMetrics) -> float | None:
    """running + waiting requests; None when the pod exported neither (valid, finite, >= 0)."""
    parts = [v for v in (m.num_requests_running, m.num_requests_waiting)
             if v is not None and math.isfinite(v) and v >= 0]
    return math.fsum(parts) if parts else None


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def deletion_costs(pods: Sequence[PodObservation]) -> dict[str, int]:
    """The ``pod-deletion-cost`` value of every pod: lower is deleted first (see the module doc).

    Args:
        pods: every non-terminating pod of the Deployment, with this tick's scrape in ``metrics``
            (None: not scraped or unreadable).
    Returns:
        {pod name: cost}; 0 for pods that are not Ready, 1..n for Ready pods, least loaded first.
    """
    ready = [p for p in pods if p.ready]
    loads = {p.name: _load(p.metrics) if p.metrics is not None else None for p in ready}
    known = [v for v in loads.values() if v is not None]
    mean_load = math.fsum(known) / len(known) if known else 0.0

    def tie(attr: str) -> dict[str, float]:
        vals = {p.name: _finite(getattr(p.metrics, attr)) if p.metrics is not None else None
                for p in ready}
        seen = [v for v in vals.values() if v is not None]
        mean = math.fsum(seen) / len(seen) if seen else 0.0
        return {k: mean if v is None else v for k, v in vals.items()}

    cached, usage = tie("kv_cache_blocks_cached"), tie("kv_cache_usage")
    ranked = sorted(ready, key=lambda p: (mean_load if loads[p.name] is None else loads[p.name],
                                          cached[p.name], usage[p.name], p.name))
    costs = {p.name: 0 for p in pods if not p.ready}
    costs.update({p.name: i + 1 for i, p in enumerate(ranked)})
    return costs
