"""Pure autoscaling policy: metric samples + history + clock in, a replica decision out (no I/O).

The algorithm is the Kubernetes HorizontalPodAutoscaler's (``pkg/controller/podautoscaler``:
``desired = ceil(readyReplicas × observed / target)``, a ±10 % tolerance band, a scale-up limit per
step, stabilization windows over past recommendations), applied to the two numbers operators of
vLLM-style servers watch, with the known failures of other autoscalers designed out:

* **Two metrics, larger wins.** Mean ``vllm:kv_cache_usage_perc`` over readable pods against
  ``targetKVCacheUsage``; waiting requests per ready pod against ``targetQueueLength``.
* **Tolerance.** A metric whose ratio observed/target lies within ``1 ± tolerance`` proposes the
  current size (no flapping from noise).
* **Hysteresis on scale-down.** A scale-down proposes the size at which the load lands on the
  band's lower edge, ``ceil(readable × ratio / (1 − tolerance))``, instead of HPA's
  ``ceil(readable × ratio)`` (which lands on the target, one noisy sample below a scale-up): after
  a scale-down the same load may rise by ``(1 + tol)/(1 − tol)`` (22 % at 10 %) before a scale-up.
* **Stabilization.** Every recommendation is kept with its timestamp. Scaling up goes to the *lowest*
  recommendation within ``scaleUpStabilizationSeconds`` (0 = at once); scaling down goes to the
  *highest* recommendation within ``scaleDownStabilizationSeconds`` (HPA's behaviour). The part of a
  window that this process has not observed (it restarted, its history is empty) counts as a
  recommendation of the current size: a restarted controller waits one full window, then still
  scales a quiet service down.
* **Step limit.** One step raises the size to at most ``max(2 × current, current + 1)``.
* **Capacity on the way, counted.** Pods that are starting (not Ready yet, not crashing, younger
  than ``startupTimeoutSeconds``) count as replicas that will carry load at the target once they
  are Ready. A scale-up goes to the recommendation ``r`` when ``r`` exceeds both the current size
  and Ready + starting; when Ready + starting already cover ``r`` the size is held
  (``ReplicasStarting``) — scaling up again for load the starting pods will take is the cascading
  failure of other autoscalers. (kvfleet's first pass held *every* scale-up while any pod started,
  which left bursts that outgrow the first new replicas queued for a whole start-up.) Older or
  crashing pods are neither capacity nor load and block nothing.
* **Missing data is neither zero nor full.** Pods that are not Ready or whose scrape failed are left
  out of the means. Scaling up extrapolates the readable pods' mean to all Ready pods; scaling down
  keeps one replica for every unreadable Ready pod (their load is unknown). When more than half of
  the Ready pods cannot be read — or none is Ready — the size is held, the hold is recorded in the
  history (as a recommendation of the current size, so a later scale-down still waits a full window
  of real data) and the reason is reported.
* **Bad samples are missing data.** A KV usage outside [0, 1] or a negative or non-finite count
  (a broken exporter) is treated like a metric the pod does not export; a Ready pod with no valid
  sample of either metric counts as unreadable.
* **Clock.** A ``now`` earlier than the history (a wall clock stepped back) discards the history, as
  after a restart: the unknown past counts as the current size for one window.
* **Bounds.** Recommendations and results are clamped to ``[minReplicas, maxReplicas]``; a size
  outside the bounds (the user changed them) is corrected at once, even while holding.

Units: seconds for every time and age (``now`` is any monotonic or wall clock, used consistently);
KV-cache usage is a fraction 0..1; queue lengths are request counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_TOLERANCE = 0.1


@dataclass(frozen=True)
class AutoscalingPolicy:
    """The autoscaling parameters of one InferenceService (``spec.autoscaling`` + the startup timeout).

    Raises ValueError naming the field when a value is out of range.
    """

    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_cache_usage: float = 0.8
    target_queue_length: float = 5.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    metrics_interval_seconds: float = 15.0
    startup_timeout_seconds: float = 1800.0
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(
                f"autoscaling.minReplicas={self.min_replicas}: not supported yet: scale to zero "
                "(requests arriving at zero replicas would not be buffered); use minReplicas >= 1")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling.maxReplicas={self.max_replicas} must be >= "
                             f"minReplicas={self.min_replicas}")
        if not 0.0 < self.target_kv_cache_usage <= 1.0:
            raise ValueError(f"autoscaling.targetKVCacheUsage={self.target_kv_cache_usage} "
                             "must be in (0, 1]")
        if not self.target_queue_length > 0:
            raise ValueError(f"autoscaling.targetQueueLength={self.target_queue_length} must be > 0")
        for name, value in (
                ("autoscaling.scaleUpStabilizationSeconds", self.scale_up_stabilization_seconds),
                ("autoscaling.scaleDownStabilizationSeconds", self.scale_down_stabilization_seconds),
                ("probes.startupTimeoutSeconds", self.startup_timeout_seconds)):
            if value < 0:
                raise ValueError(f"{name}={value} must be >= 0")
        if not self.metrics_interval_seconds > 0:
            raise ValueError(f"autoscaling.metricsIntervalSeconds={self.metrics_interval_seconds} "
                             "must be > 0")
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance={self.tolerance} must be in [0, 1)")

    @classmethod
    def from_spec(cls, spec: Mapping) -> AutoscalingPolicy:
        """Build from an InferenceService ``spec`` mapping (camelCase, as stored in the API).

        Defaults and bounds are those of ``kvfleet_operator.api`` (the CRD's source); an omitted
        ``maxReplicas`` means ``minReplicas``. Raises ValueError (pydantic's, naming the field) on
        values the schema refuses.
        """
        from . import api  # pydantic models: the single source of the defaults

        a = api.Autoscaling.model_validate(spec.get("autoscaling") or {})
        probes = api.Probes.model_validate(spec.get("probes") or {})
        return cls(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas if a.max_replicas is not None else a.min_replicas,
            target_kv_cache_usage=a.target_kv_cache_usage,
            target_queue_length=a.target_queue_length,
            scale_up_stabilization_seconds=a.scale_up_stabilization_seconds,
            scale_down_stabilization_seconds=a.scale_down_stabilization_seconds,
            metrics_interval_seconds=a.metrics_interval_seconds,
            startup_timeout_seconds=probes.startup_timeout_seconds,
        )


@dataclass(frozen=True)
class PodMetrics:
    """What one pod's /metrics said. ``None`` fields: the server did not export that metric.

    kv_cache_usage: fraction of KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``).
    num_requests_waiting / num_requests_running: request counts (vLLM's gauges of those names).
    kv_cache_blocks_cached: free KV blocks still holding a reusable prefix
    (``kvfleet:kv_cache_blocks_cached``; vLLM exports none) — not a decision input, it only
    orders the pods a scale-down removes (``kvfleet_operator.deletion_cost``).
    """

    kv_cache_usage: float | None = None
    num_requests_waiting: float | None = None
    num_requests_running: float | None = None
    kv_cache_blocks_cached: float | None = None


@dataclass(frozen=True)
class PodObservation:
    """One pod of the Deployment at decision time.

    ready: the pod's Ready condition is True.
    age_seconds: seconds since the pod was created (used for starting pods).
    crashing: the pod's container restarted or failed (CrashLoopBackOff, Error, phase Failed) — it is
        neither capacity on the way nor load.
    metrics: the scrape result for a Ready pod, ``None`` when it failed or was not attempted.
    """

    name: str
    ready: bool
    age_seconds: float = 0.0
    crashing: bool = False
    metrics: PodMetrics | None = None


@dataclass(frozen=True)
class Recommendation:
    """A past recommendation: ``replicas`` proposed at time ``at`` (seconds)."""

    at: float
    replicas: int


@dataclass(frozen=True)
class History:
    """Recommendations this process has made, oldest first, and when it started observing.

    ``started_at`` None means nothing has been observed yet (fresh start or restart).
    """

    recommendations: tuple[Recommendation, ...] = ()
    started_at: float | None = None


@dataclass(frozen=True)
class Decision:
    """The outcome of one evaluation.

    desired_replicas: the size to apply. current_replicas: the size that was asked for before.
    changed: desired != current. reason: one line for status/Events, e.g.
    "kv cache usage 0.93 > target 0.80". holds: why a wanted change was not made (empty if none).
    recommendation: this evaluation's clamped recommendation before stabilization (None when held
    for missing data). history: pass it to the next call. Observed figures (None when unknown):
    kv_cache_usage (mean over readable pods), waiting_per_replica, ready, readable, starting
    (starting replicas counted as capacity on the way; their names are in reason).
    """

    desired_replicas: int
    current_replicas: int
    changed: bool
    reason: str
    holds: tuple[str, ...]
    recommendation: int | None
    history: History
    kv_cache_usage: float | None = None
    waiting_per_replica: float | None = None
    ready: int = 0
    readable: int = 0
    starting: int = 0
    direction: str = field(default="none")  # "up", "down" or "none"
    # CamelCase reason for status/Events: KVCacheUsageHigh, QueueLengthHigh, LoadLow, WithinTarget,
    # ReplicasStarting, ScaleUpStabilizing, ScaleDownStabilizing, ScalingLimited (at maxReplicas,
    # the load asks for more), MetricsUnavailable, BelowMinReplicas, AboveMaxReplicas.
    code: str = "WithinTarget"


@dataclass(frozen=True)
class _Proposal:
    replicas: int
    ratio: float
    text: str  # "kv cache usage 0.93" / "waiting requests 7.5/replica"
    target_text: str  # "0.80" / "5"
    code: str  # the reason code when this metric drives a scale-up


_MAX_PROPOSAL = 10**9  # replicas; any maxReplicas is far below (keeps ceil() away from inf)


def _mean(values: Sequence[float]) -> float:
    """Mean that cannot overflow to inf for finite inputs (queue counts near float max)."""
    return math.fsum(v / len(values) for v in values)


def _metric_proposal(values: Sequence[float], target: float, ready: int, current: int,
                     tolerance: float, label: str, fmt: str, target_fmt: str, unit: str,
                     code: str) -> _Proposal | None:
    """HPA's per-metric formula over the readable pods' values; None when no pod exported it."""
    if not values:
        return None
    readable = len(values)
    mean = _mean(values)
    ratio = mean / target
    text = f"{label} {format(mean, fmt if mean < 1e6 else '.3g')}{unit}"  # no 300-digit reasons
    target_text = format(target, target_fmt)
    if abs(ratio - 1.0) <= tolerance:
        return _Proposal(current, ratio, text, target_text, code)
    # A load above the band never proposes fewer replicas than asked for, a load below it never
    # more (keeps the recommendation monotone in load when Ready != asked-for replicas).
    if ratio > 1.0:
        # Unreadable Ready pods are assumed to carry the readable pods' mean load.
        want = ready * ratio  # finite: values are finite, so is their mean; huge -> capped
        n = math.ceil(want - 1e-9) if want < _MAX_PROPOSAL else _MAX_PROPOSAL
        return _Proposal(max(current, n), ratio, text, target_text, code)
    # Scaling down: the readable pods' load needs ceil(readable × ratio / (1 - tolerance))
    # replicas — the size at which it sits at the *lower* edge of the band, not at the target, so
    # that the same load plus noise within the band cannot ask for a scale-up right after (HPA
    # lands on the target, one +10 % sample away from scaling up again). Every unreadable Ready
    # pod keeps its replica (its load is unknown, never assumed zero).
    n = math.ceil(readable * ratio / (1.0 - tolerance) - 1e-9) + (ready - readable)
    return _Proposal(min(current, n), ratio, text, target_text, code)


def _valid(value: float | None, upper: float) -> float | None:
    """``value`` if it is a finite number in [0, upper], else None (a broken sample is no data)."""
    if value is None or not math.isfinite(value) or not 0.0 <= value <= upper:
        return None
    return float(value)


def _sanitized(m: PodMetrics | None) -> PodMetrics | None:
    """A pod's metrics with invalid samples dropped; None when neither decision metric is valid."""
    if m is None:
        return None
    kv, waiting = _valid(m.kv_cache_usage, 1.0), _valid(m.num_requests_waiting, math.inf)
    if kv is None and waiting is None:
        return None
    return PodMetrics(kv, waiting, _valid(m.num_requests_running, math.inf),
                      _valid(m.kv_cache_blocks_cached, math.inf))


def _counted_text(starting: Sequence[PodObservation], names: int = 3) -> str:
    """'2 starting counted (a, b)': the starting replicas counted as capacity, first few named."""
    shown = ", ".join(p.name for p in starting[:names])
    more = f", +{len(starting) - names} more" if len(starting) > names else ""
    return f"{len(starting)} starting counted ({shown}{more})"


def _clamp(n: int, policy: AutoscalingPolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def _window_values(history: History, now: float, window: float) -> list[int]:
    return [r.replicas for r in history.recommendations if r.at > now - window]


def _prune(recs: Sequence[Recommendation], now: float, keep: float) -> tuple[Recommendation, ...]:
    return tuple(r for r in recs if r.at > now - keep)


def decide(policy: AutoscalingPolicy, current_replicas: int, pods: Sequence[PodObservation],
           history: History, now: float) -> Decision:
    """Decide the replica count of one InferenceService.

    Args:
        policy: the object's autoscaling parameters.
        current_replicas: the Deployment's ``spec.replicas`` (what was last asked for), >= 0.
        pods: every pod of the Deployment that is not terminating.
        history: the previous Decision's ``history`` (``History()`` after a start).
        now: the current time in seconds (same clock as the history).

    Returns a Decision; see the module docstring for the rules. Raises ValueError when
    current_replicas is negative.
    """
    if current_replicas < 0:
        raise ValueError(f"current_replicas={current_replicas} must be >= 0")
    if (history.started_at is not None and now < history.started_at) or any(
            r.at > now for r in history.recommendations):
        history = History()  # the clock went backwards: the past is unknown, as after a restart
    started_at = history.started_at if history.started_at is not None else now
    keep = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)

    ready_pods = [p for p in pods if p.ready]
    starting = [p for p in pods if not p.ready and not p.crashing
                and p.age_seconds <= policy.startup_timeout_seconds]
    metrics = [_sanitized(p.metrics) for p in ready_pods]
    readable = [m for m in metrics if m is not None]
    n_ready, n_readable = len(ready_pods), len(readable)

    kv_values = [m.kv_cache_usage for m in readable if m.kv_cache_usage is not None]
    wait_values = [m.num_requests_waiting for m in readable if m.num_requests_waiting is not None]
    kv_mean = _mean(kv_values) if kv_values else None
    wait_mean = _mean(wait_values) if wait_values else None
    observed = dict(kv_cache_usage=kv_mean, waiting_per_replica=wait_mean, ready=n_ready,
                    readable=n_readable, starting=len(starting))

    def finish(desired: int, reason: str, holds: tuple[str, ...], rec: int | None,
               recs: tuple[Recommendation, ...], code: str) -> Decision:
        direction = "up" if desired > current_replicas else "down" if desired < current_replicas else "none"
        return Decision(desired_replicas=desired, current_replicas=current_replicas,
                        changed=desired != current_replicas, reason=reason, holds=holds,
                        recommendation=rec,
                        history=History(_prune(recs, now, keep), started_at),
                        direction=direction, code=code, **observed)

    # --- Not enough data: hold (but always honour the bounds). -------------------------------
    hold_why = None
    # Asked-for pods the Deployment controller has not created yet are on their way too (they only
    # name the hold; they never hold a scale-up, so a Deployment that cannot create pods blocks nothing).
    on_the_way = len(starting) + max(0, current_replicas - len(pods))
    if n_ready == 0:
        hold_why = (f"no Ready pods to measure yet ({on_the_way} starting)" if on_the_way
                    else "no Ready pods to measure")
    elif n_ready - n_readable > n_ready / 2:
        hold_why = f"metrics of {n_ready - n_readable} of {n_ready} Ready pods unreadable"
        if n_readable == 0 and any(p.metrics is not None for p in ready_pods):
            hold_why += (" (no valid vllm:kv_cache_usage_perc or vllm:num_requests_waiting "
                         "sample)")
    if hold_why is not None:
        recs = history.recommendations + (Recommendation(now, _clamp(current_replicas, policy)),)
        desired = _clamp(current_replicas, policy)
        if desired != current_replicas:
            reason = (f"replicas {current_replicas} outside [{policy.min_replicas}, "
                      f"{policy.max_replicas}]; holding otherwise: {hold_why}")
            code = "BelowMinReplicas" if desired > current_replicas else "AboveMaxReplicas"
        else:
            reason = f"holding at {current_replicas}: {hold_why}"
            # Nothing Ready yet while pods start (a fresh deployment) is normal, not a failure.
            code = "ReplicasStarting" if n_ready == 0 and on_the_way else "MetricsUnavailable"
        return finish(desired, reason, (hold_why,), None, recs, code)

    # --- Per-metric proposals (HPA formula), larger wins. ------------------------------------
    proposals = [p for p in (
        _metric_proposal(kv_values, policy.target_kv_cache_usage, n_ready, current_replicas,
                         policy.tolerance, "kv cache usage", ".2f", ".2f", "", "KVCacheUsageHigh"),
        _metric_proposal(wait_values, policy.target_queue_length, n_ready, current_replicas,
                         policy.tolerance, "waiting requests", ".1f", "g", "/replica",
                         "QueueLengthHigh"),
    ) if p is not None]
    # Wins: the largest proposal; on equal proposals, the metric further from its target.
    winner = max(proposals, key=lambda p: (p.replicas, abs(p.ratio - 1.0)))
    rec = _clamp(winner.replicas, policy)
    recs = history.recommendations + (Recommendation(now, rec),)

    # --- Stabilization windows; the unobserved part of a window counts as the current size. ----
    up_window = policy.scale_up_stabilization_seconds
    down_window = policy.scale_down_stabilization_seconds
    up_vals = _window_values(history, now, up_window) + [rec]
    down_vals = _window_values(history, now, down_window) + [rec]
    if now - started_at < up_window:
        up_vals.append(current_replicas)
    if now - started_at < down_window:
        down_vals.append(current_replicas)
    up_target, down_target = min(up_vals), max(down_vals)

    holds: list[str] = []
    if up_target > current_replicas:
        desired = up_target
    elif down_target < current_replicas:
        desired = down_target
    else:
        desired = current_replicas
        if rec > current_replicas:
            holds.append(f"scale-up to {rec} waits for the {up_window:g}s scale-up window")
        elif rec < current_replicas:
            holds.append(f"scale-down to {rec} waits for the {down_window:g}s scale-down window "
                         f"(highest recent recommendation {down_target})")
        elif winner.replicas > policy.max_replicas >= current_replicas:
            holds.append(f"{winner.text} asks for {winner.replicas} replicas; limited by "
                         f"maxReplicas {policy.max_replicas}")

    # --- Capacity on the way (counted, not frozen), then the scale-up step limit. -------------
    capacity = n_ready + len(starting)
    counted = _counted_text(starting)
    if desired > current_replicas:
        if starting and desired <= capacity:
            holds.append(f"scale-up to {desired} held: covered by {n_ready} Ready + "
                         f"{counted} (capacity on the way)")
            desired = current_replicas
        else:
            limit = max(2 * current_replicas, current_replicas + 1)
            if desired > limit:
                holds.append(f"scale-up limited to {limit} this step (wanted {desired})")
                desired = limit
    elif (starting and winner.ratio - 1.0 > policy.tolerance and n_ready < rec <= capacity
          and desired == current_replicas and not holds):
        # The load needs more than the Ready pods; the starting ones are counted to cover it.
        holds.append(f"recommendation {rec} covered by {n_ready} Ready + {counted} "
                     "(capacity on the way)")

    desired_clamped = _clamp(desired, policy)
    if desired_clamped != desired:
        holds.append(f"clamped to [{policy.min_replicas}, {policy.max_replicas}]")
        desired = desired_clamped

    # --- The reason line. ------------------------------------------------------------------
    if desired > current_replicas:
        if winner.ratio > 1.0:
            reason = f"{winner.text} > target {winner.target_text}"
            if starting:
                reason += f"; {counted}"
            code = winner.code
        else:
            reason = f"raised to minReplicas {policy.min_replicas}"
            code = "BelowMinReplicas"
    elif desired < current_replicas:
        if current_replicas > policy.max_replicas and desired == policy.max_replicas:
            reason = f"lowered to maxReplicas {policy.max_replicas}"
            code = "AboveMaxReplicas"
        else:
            code = "LoadLow"
            parts = [f"{p.text} < target {p.target_text}" for p in proposals]
            reason = " and ".join(parts) + (f" for {down_window:g}s" if down_window else "")
    else:
        parts = [f"{p.text} (target {p.target_text})" for p in proposals]
        reason = f"steady at {current_replicas}: " + ", ".join(parts)
        if holds:
            reason += "; " + "; ".join(holds)
        last = holds[-1] if holds else ""
        code = ("ReplicasStarting" if "capacity on the way" in last
                else "ScaleUpStabilizing" if "scale-up window" in last
                else "ScaleDownStabilizing" if "scale-down window" in last
                else "ScalingLimited" if "limited by maxReplicas" in last else "WithinTarget")
    return finish(desired, reason, tuple(holds), rec, recs, code)
