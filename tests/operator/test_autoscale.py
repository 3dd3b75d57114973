"""Table tests of the pure autoscaling policy (kvfleet_operator.autoscale.decide)."""

from __future__ import annotations

import pytest

from kvfleet_operator.autoscale import (AutoscalingPolicy, History, PodMetrics, PodObservation,
                                        Recommendation, decide)

POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=10, scale_down_stabilization_seconds=300,
                           startup_timeout_seconds=600)


def ready(n: int, kv: float | None = 0.5, waiting: float | None = 0.0) -> list[PodObservation]:
    return [PodObservation(f"p{i}", ready=True, age_seconds=1000,
                           metrics=PodMetrics(kv_cache_usage=kv, num_requests_waiting=waiting,
                                              num_requests_running=1))
            for i in range(n)]


def starting(n: int, age: float = 30.0) -> list[PodObservation]:
    return [PodObservation(f"s{i}", ready=False, age_seconds=age) for i in range(n)]


def unreadable(n: int) -> list[PodObservation]:
    return [PodObservation(f"u{i}", ready=True, age_seconds=1000, metrics=None) for i in range(n)]


def warm_history(now: float, replicas: int) -> History:
    """A history that has observed a full window at `replicas` (as after a long steady period)."""
    return History((Recommendation(now - 400, replicas),), started_at=now - 1000)


@pytest.mark.parametrize("current,pods,expected,reason_part", [
    # HPA formula on KV usage: ceil(2 × 0.95 / 0.8) = 3.
    (2, ready(2, kv=0.95), 3, "kv cache usage 0.95 > target 0.80"),
    # Queue: 12 waiting per replica vs 5 -> ceil(2 × 12/5) = 5, limited to double (4).
    (2, ready(2, kv=0.5, waiting=12), 4, "waiting requests 12.0/replica > target 5"),
    # Larger metric wins: KV wants 3, queue wants 4.
    (2, ready(2, kv=0.95, waiting=10), 4, "waiting requests 10.0/replica > target 5"),
    # Within the 10% band: 0.86/0.8 = 1.075 -> no change.
    (3, ready(3, kv=0.86, waiting=5.4), 3, "steady at 3"),
    (3, ready(3, kv=0.73, waiting=4.6), 3, "steady at 3"),
    # Just outside the band scales: 0.89/0.8 = 1.1125 -> ceil(3.34) = 4.
    (3, ready(3, kv=0.89), 4, "kv cache usage 0.89 > target 0.80"),
    # Upper bound.
    (8, ready(8, kv=1.0, waiting=50), 10, "waiting requests"),
    # At least +1 from one replica even though ceil(1 × 1.2) = 2 == double anyway; from 1 with huge
    # load the step limit is double (2).
    (1, ready(1, kv=0.5, waiting=100), 2, "waiting requests 100.0/replica"),
])
def test_scale_up_table(current, pods, expected, reason_part):
    now = 10_000.0
    d = decide(POLICY, current, pods, warm_history(now, current), now)
    assert d.desired_replicas == expected
    assert d.changed == (expected != current)
    assert reason_part in d.reason


def test_scale_down_waits_for_highest_recommendation_in_window():
    now = 10_000.0
    # Load fell: 4 replicas at KV 0.1 need ceil(4 × 0.125) = 1; but 200 s ago 4 were recommended.
    hist = History((Recommendation(now - 200, 4),), started_at=now - 1000)
    d = decide(POLICY, 4, ready(4, kv=0.1), hist, now)
    assert d.desired_replicas == 4 and not d.changed
    assert d.recommendation == 1
    assert any("scale-down" in h for h in d.holds)
    # 301 s later the high recommendation has left the window: down to the window's highest.
    later = now + 101
    d2 = decide(POLICY, 4, ready(4, kv=0.1), d.history, later)
    assert d2.desired_replicas == 1 and d2.direction == "down"
    assert "kv cache usage 0.10 < target 0.80" in d2.reason and d2.code == "LoadLow"
    assert d.code == "ScaleDownStabilizing"


def test_scale_down_goes_to_highest_recent_recommendation_not_lowest():
    now = 10_000.0
    hist = History((Recommendation(now - 250, 3), Recommendation(now - 100, 2)), started_at=now - 1000)
    d = decide(POLICY, 5, ready(5, kv=0.1), hist, now)
    assert d.desired_replicas == 3


def test_restart_with_empty_history_scales_down_after_one_window():
    quiet = ready(4, kv=0.05, waiting=0)
    hist = History()
    t0 = 50_000.0
    t, d = t0, None
    sizes = []
    while t <= t0 + 330:
        d = decide(POLICY, 4, quiet, hist, t)
        hist = d.history
        sizes.append((t - t0, d.desired_replicas))
        t += 15
    # No scale-down inside the first window after the restart (history unknown) ...
    assert all(n == 4 for dt, n in sizes if dt < 300)
    # ... but once the window has passed, the quiet service goes to minReplicas.
    assert sizes[-1][1] == 1


def crashing(n: int) -> list[PodObservation]:
    return [PodObservation(f"c{i}", ready=False, age_seconds=20, crashing=True) for i in range(n)]


@pytest.mark.parametrize("current,pods,max_replicas,expected,code,reason_part", [
    # The case: 2 loaded Ready pods (queue 20 vs target 5: r = ceil(2 × 4) = 8, clamped
    # to 4) + 1 starting = 3 < 4 -> 4, and the counted starting pod is named.
    (3, ready(2, kv=1.0, waiting=20) + starting(1), 4, 4, "QueueLengthHigh",
     "waiting requests 20.0/replica > target 5; 1 starting counted (s0)"),
    # Same load, room to grow: r = 8 > 3, step-limited to 2 × 3 = 6.
    (3, ready(2, kv=1.0, waiting=20) + starting(1), 10, 6, "QueueLengthHigh", "1 starting counted"),
    # The queue grew while 2 replicas start: r = ceil(2 × 20/5) = 8 > 2 + 2 -> 8 (was held).
    (4, ready(2, kv=0.7, waiting=20) + starting(2, age=15), 10, 8, "QueueLengthHigh",
     "2 starting counted (s0, s1)"),
    # Many starting pods: the first three are named.
    (6, ready(2, kv=0.7, waiting=40) + starting(4), 10, 10, "QueueLengthHigh",
     "4 starting counted (s0, s1, s2, +1 more)"),
    # Covered: the same 2 Ready pods need ceil(2 × 7/5) = 3 = 2 Ready + 1 starting: no change,
    # and the status says the starting pod is counted.
    (3, ready(2, kv=0.5, waiting=7) + starting(1), 4, 3, "ReplicasStarting",
     "recommendation 3 covered by 2 Ready + 1 starting counted (s0)"),
    # Covered although r exceeds the asked-for size (a rolling update's surge pod is starting):
    # r = 3 <= 2 Ready + 1 starting -> held, no cascade.
    (2, ready(2, kv=0.5, waiting=7) + starting(1), 4, 2, "ReplicasStarting",
     "scale-up to 3 held: covered by 2 Ready + 1 starting counted (s0)"),
    # A pod starting for longer than startupTimeoutSeconds is not counted (not capacity).
    (4, ready(2, kv=0.7, waiting=20) + starting(2, age=601), 10, 8, "QueueLengthHigh",
     "waiting requests 20.0/replica > target 5"),
    # Crashing pods are not counted: 2 Ready + 1 crashing at r = 3 = current: steady, no hold.
    (3, ready(2, kv=0.5, waiting=7) + crashing(1), 4, 3, "WithinTarget", "steady at 3"),
])
def test_starting_replicas_count_as_capacity(current, pods, max_replicas, expected, code, reason_part):
    now = 10_000.0
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=max_replicas,
                               scale_down_stabilization_seconds=300, startup_timeout_seconds=600)
    d = decide(policy, current, pods, warm_history(now, current), now)
    assert (d.desired_replicas, d.code) == (expected, code), d.reason
    assert reason_part in d.reason
    if "starting counted" not in reason_part:
        assert "starting counted" not in d.reason
    assert d.starting == sum(1 for p in pods if not p.ready and not p.crashing and p.age_seconds <= 600)


def test_starting_replicas_no_cascade_for_the_same_load():
    """After a scale-up, while the new pods start, the same load asks for nothing more."""
    now = 10_000.0
    d1 = decide(POLICY, 2, ready(2, kv=0.6, waiting=9), warm_history(now, 2), now)
    assert d1.desired_replicas == 4 and d1.code == "QueueLengthHigh"  # ceil(2 × 9/5) = 4
    pods = ready(2, kv=0.6, waiting=9) + starting(2, age=15)
    d2 = decide(POLICY, 4, pods, d1.history, now + 15)
    assert d2.desired_replicas == 4 and not d2.changed and d2.code == "ReplicasStarting"
    assert "covered by 2 Ready + 2 starting counted (s0, s1)" in d2.reason


def test_crashing_pod_does_not_block_decisions():
    now = 10_000.0
    crash = PodObservation("c", ready=False, age_seconds=20, crashing=True)
    d = decide(POLICY, 3, ready(2, kv=0.95) + [crash], warm_history(now, 3), now)
    # KV wants ceil(2 × 0.95/0.8) = 3 = current: steady, not held by the crashing pod.
    assert not d.holds
    d = decide(POLICY, 3, ready(2, kv=0.5, waiting=20) + [crash], warm_history(now, 3), now)
    assert d.desired_replicas == 6


@pytest.mark.parametrize("pods,hold_part", [
    (unreadable(2) + ready(1, kv=0.0), "metrics of 2 of 3 Ready pods unreadable"),
    (unreadable(1), "metrics of 1 of 1 Ready pods unreadable"),
    (starting(3), "no Ready pods"),
    ([PodObservation("x", ready=True, age_seconds=5, metrics=PodMetrics())],
     "no valid vllm:kv_cache_usage_perc or vllm:num_requests_waiting"),
    # A broken exporter's samples (NaN, negative, KV > 1) are no data: 2 of 3 pods unreadable.
    (ready(1, kv=0.5) + [PodObservation(f"b{i}", ready=True, age_seconds=1000,
                                        metrics=PodMetrics(bad, -bad, 1))
                         for i, bad in enumerate((float("nan"), float("inf")))],
     "metrics of 2 of 3 Ready pods unreadable"),
])
def test_missing_data_holds_with_reason(pods, hold_part):
    now = 10_000.0
    d = decide(POLICY, 3, pods, warm_history(now, 3), now)
    assert d.desired_replicas == 3 and not d.changed
    assert hold_part in d.reason
    assert d.recommendation is None
    # The hold is recorded as "keep 3": a later scale-down still needs a full window of data.
    assert d.history.recommendations[-1].replicas == 3


def test_nothing_ready_yet_while_pods_start_is_not_a_metrics_failure():
    now = 10_000.0
    d = decide(POLICY, 2, starting(2), History(), now)
    assert d.desired_replicas == 2 and d.code == "ReplicasStarting" and "2 starting" in d.reason
    d = decide(POLICY, 2, [], History(), now)  # the Deployment controller has not created them yet
    assert d.desired_replicas == 2 and d.code == "ReplicasStarting"
    crashing = [PodObservation(f"c{i}", ready=False, age_seconds=5, crashing=True) for i in range(2)]
    d = decide(POLICY, 2, crashing, History(), now)
    assert d.desired_replicas == 2 and d.code == "MetricsUnavailable"


def test_hold_still_honours_bounds():
    now = 10_000.0
    d = decide(POLICY, 12, unreadable(12), warm_history(now, 12), now)
    assert d.desired_replicas == 10 and "outside [1, 10]" in d.reason


def test_half_unreadable_still_decides_and_keeps_unknown_pods():
    now = 10_000.0
    # 4 ready, 2 unreadable (exactly half): decide from the other 2.
    pods = unreadable(2) + ready(2, kv=0.0, waiting=0)
    d = decide(POLICY, 4, pods, warm_history(now, 1), now)
    # Readable pods are idle (need 0) but the 2 unreadable ones keep their replicas: 2, never 1.
    assert d.desired_replicas == 2
    # Scaling up extrapolates the readable mean to every Ready pod: ceil(4 × 1.0/0.8) = 5.
    pods = unreadable(2) + ready(2, kv=1.0, waiting=0)
    d = decide(POLICY, 4, pods, warm_history(now, 4), now)
    assert d.desired_replicas == 5


def test_below_min_and_above_max_are_corrected():
    now = 10_000.0
    d = decide(POLICY, 0, [], History(), now)
    assert d.desired_replicas == 1 and d.changed
    d = decide(POLICY, 15, ready(15, kv=0.8, waiting=5), warm_history(now, 15), now)
    assert d.desired_replicas == 10 and "maxReplicas 10" in d.reason


def test_scale_up_stabilization_window_takes_lowest_recommendation():
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=10, scale_up_stabilization_seconds=60)
    now = 10_000.0
    hist = History((Recommendation(now - 30, 2),), started_at=now - 1000)
    d = decide(policy, 2, ready(2, kv=1.0), hist, now)
    assert d.desired_replicas == 2 and any("scale-up window" in h for h in d.holds)
    d2 = decide(policy, 2, ready(2, kv=1.0), d.history, now + 31)
    assert d2.desired_replicas == 3


@pytest.mark.parametrize("kwargs,field", [
    (dict(min_replicas=0, max_replicas=3), "minReplicas"),
    (dict(min_replicas=4, max_replicas=3), "maxReplicas"),
    (dict(target_kv_cache_usage=0.0), "targetKVCacheUsage"),
    (dict(target_kv_cache_usage=1.5), "targetKVCacheUsage"),
    (dict(target_queue_length=0), "targetQueueLength"),
    (dict(scale_down_stabilization_seconds=-1), "scaleDownStabilizationSeconds"),
    (dict(metrics_interval_seconds=0), "metricsIntervalSeconds"),
    (dict(startup_timeout_seconds=-5), "startupTimeoutSeconds"),
])
def test_bad_policy_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AutoscalingPolicy(**kwargs)


def test_policy_from_spec_defaults_and_values():
    p = AutoscalingPolicy.from_spec({"autoscaling": {"enabled": True, "minReplicas": 2,
                                                     "maxReplicas": 6}})
    assert (p.min_replicas, p.max_replicas, p.target_kv_cache_usage, p.target_queue_length) == (2, 6, 0.8, 5)
    assert (p.scale_up_stabilization_seconds, p.scale_down_stabilization_seconds,
            p.metrics_interval_seconds, p.startup_timeout_seconds) == (0, 300, 15, 1800)
    p = AutoscalingPolicy.from_spec({"autoscaling": {"minReplicas": 1, "maxReplicas": 3,
                                                     "targetKVCacheUsage": 0.7,
                                                     "metricsIntervalSeconds": 5},
                                     "probes": {"startupTimeoutSeconds": 120}})
    assert (p.target_kv_cache_usage, p.metrics_interval_seconds, p.startup_timeout_seconds) == (0.7, 5, 120)


def test_load_below_band_never_proposes_more_and_above_never_fewer():
    now = 10_000.0
    # 3 Ready pods while 2 are asked for (surge or scale-down in progress), light load:
    # ceil(3 × 0.6/0.8) = 3 would be a "scale-up" from light load; never.
    d = decide(POLICY, 2, ready(3, kv=0.6), warm_history(now, 2), now)
    assert d.desired_replicas <= 2 and d.recommendation <= 2
    # 2 Ready + 2 starting, heavy load: ceil(2 × 1.2) = 3 < 4 must not count as a scale-down wish.
    d = decide(POLICY, 4, ready(2, kv=0.96) + starting(2), warm_history(now, 4), now)
    assert d.recommendation == 4 and d.desired_replicas == 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, 1.7])
def test_a_bad_kv_sample_is_missing_data_not_load(bad):
    """One pod's broken KV gauge neither crashes the decision nor moves it: it counts like a pod
    that does not export the metric (its replica is kept on a scale-down)."""
    now = 10_000.0
    broken = [PodObservation("bad", ready=True, age_seconds=1000,
                             metrics=PodMetrics(kv_cache_usage=bad, num_requests_waiting=0.0))]
    d = decide(POLICY, 3, ready(2, kv=0.05) + broken, warm_history(now - 400, 1), now)
    # The 2 readable pods need 1 replica; the broken one keeps its own: 2 (0.05 alone would say 1).
    assert d.desired_replicas == 2 and d.kv_cache_usage == pytest.approx(0.05)
    d = decide(POLICY, 3, ready(2, kv=0.95) + broken, warm_history(now, 3), now)
    # Scaling up extrapolates the readable mean to it: ceil(3 × 0.95/0.8) = 4.
    assert d.desired_replicas == 4
    d = decide(POLICY, 2, [PodObservation("w", True, 1000, metrics=PodMetrics(0.5, float("inf"), 1))] * 2,
               warm_history(now, 2), now)
    assert d.desired_replicas == 2 and d.waiting_per_replica is None


def test_clock_going_backwards_counts_as_a_restart():
    """History stamped in the future (a wall clock stepped back) would block scale-downs until the
    clock caught up; it is discarded instead and a quiet service goes down one window later."""
    now = 10_000.0
    hist = History((Recommendation(now + 3000, 8),), started_at=now - 1000)
    sizes = []
    t = now
    while t <= now + 330:
        d = decide(POLICY, 4, ready(4, kv=0.05), hist, t)
        hist = d.history
        sizes.append((t - now, d.desired_replicas))
        t += 15
    assert all(n == 4 for dt, n in sizes if dt < 300)
    assert sizes[-1][1] == 1
    assert all(r.at <= now + 330 for r in hist.recommendations)


def test_at_max_replicas_with_more_load_says_so():
    policy = AutoscalingPolicy(min_replicas=3, max_replicas=3)
    now = 10_000.0
    d = decide(policy, 3, ready(3, kv=1.0, waiting=40), warm_history(now, 3), now)
    assert d.desired_replicas == 3 and d.code == "ScalingLimited"
    assert "asks for 24 replicas; limited by maxReplicas 3" in d.reason


def test_huge_queue_is_reported_readably():
    now = 10_000.0
    d = decide(POLICY, 2, ready(2, waiting=1e300), warm_history(now, 2), now)
    assert d.desired_replicas == 4 and "waiting requests 1e+300/replica > target 5" in d.reason
    # Near float max, summing would overflow to inf (and ceil(inf) raise): still a plain scale-up.
    tiny_target = AutoscalingPolicy(min_replicas=1, max_replicas=10, target_queue_length=0.001)
    d = decide(tiny_target, 2, ready(2, waiting=1.7e308), warm_history(now, 2), now)
    assert d.desired_replicas == 4 and d.waiting_per_replica == pytest.approx(1.7e308)


def test_scale_down_lands_on_the_lower_band_edge_not_the_target():
    """10 pods at KV 0.60 (ratio 0.75): HPA's ceil(10 × 0.75) = 8 would put the load at 0.75 per
    pod, one +10 % sample from a scale-up; kvfleet goes to ceil(7.5 / 0.9) = 9 (0.67 per pod)."""
    now = 10_000.0
    d = decide(POLICY, 10, ready(10, kv=0.6, waiting=0), warm_history(now - 400, 1), now)
    assert d.desired_replicas == 9 and d.code == "LoadLow"
    # Just below the band (ratio 0.85): no smaller size puts the load at <= 0.9 of the target.
    d = decide(POLICY, 10, ready(10, kv=0.68, waiting=0), warm_history(now - 400, 1), now)
    assert d.desired_replicas == 10
