"""Hypothesis properties of the pure autoscaling policy (kvfleet_operator.autoscale.decide)."""

from __future__ import annotations

import dataclasses

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvfleet_operator.autoscale import (AutoscalingPolicy, History, PodMetrics, PodObservation,
                                        Recommendation, decide)

NOW = 100_000.0


@st.composite
def policies(draw):
    lo = draw(st.integers(1, 6))
    hi = draw(st.integers(lo, 16))
    return AutoscalingPolicy(
        min_replicas=lo, max_replicas=hi,
        target_kv_cache_usage=draw(st.sampled_from([0.5, 0.7, 0.8, 0.9])),
        target_queue_length=draw(st.sampled_from([1, 3, 5, 10])),
        scale_up_stabilization_seconds=draw(st.sampled_from([0, 30, 120])),
        scale_down_stabilization_seconds=draw(st.sampled_from([0, 60, 300])),
        startup_timeout_seconds=draw(st.sampled_from([60, 600])),
    )


metrics = st.builds(PodMetrics,
                    kv_cache_usage=st.one_of(st.none(), st.floats(0, 1)),
                    num_requests_waiting=st.one_of(st.none(), st.integers(0, 200).map(float)),
                    num_requests_running=st.integers(0, 64).map(float))

pods = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3),
                          ready=st.booleans(), age_seconds=st.floats(0, 2000),
                          crashing=st.booleans(), metrics=st.one_of(st.none(), metrics)),
                max_size=12)


@st.composite
def histories(draw):
    recs = draw(st.lists(st.tuples(st.floats(0, 600), st.integers(0, 20)), max_size=8))
    recs = tuple(sorted((Recommendation(NOW - age, n) for age, n in recs), key=lambda r: r.at))
    started = draw(st.one_of(st.none(), st.floats(0, 2000).map(lambda a: NOW - a)))
    return History(recs, started)


@settings(max_examples=400, deadline=None)
@given(policies(), st.integers(0, 20), pods, histories())
def test_always_within_bounds(policy, current, observed, history):
    d = decide(policy, current, observed, history, NOW)
    assert policy.min_replicas <= d.desired_replicas <= policy.max_replicas
    assert d.changed == (d.desired_replicas != current)


@st.composite
def in_band_fleet(draw, policy):
    """Ready pods whose mean KV usage and mean queue are inside the tolerance band."""
    n = draw(st.integers(1, 10))
    band = policy.tolerance * 0.99
    kv_ratio = draw(st.floats(1 - band, min(1 + band, 1 / policy.target_kv_cache_usage)))
    q_ratio = draw(st.floats(1 - band, 1 + band))
    kv = policy.target_kv_cache_usage * kv_ratio
    q = policy.target_queue_length * q_ratio
    return [PodObservation(f"p{i}", True, 1000, False, PodMetrics(kv, q, 1.0)) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(st.data(), policies(), histories(), st.integers(0, 3))
def test_inside_tolerance_band_nothing_changes(data, policy, history, n_starting):
    fleet = data.draw(in_band_fleet(policy))
    current = data.draw(st.integers(policy.min_replicas, policy.max_replicas))
    extra = [PodObservation(f"s{i}", False, 10.0) for i in range(n_starting)]
    d = decide(policy, current, fleet + extra, history, NOW)
    assert d.desired_replicas == current and not d.changed


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(1, 8), st.floats(0.0, 1.0), st.integers(0, 100), st.floats(1, 59))
def test_starting_replicas_suppress_second_scale_up(policy, n_ready, kv, waiting, age):
    """No cascade: after a scale-up, while the new replicas start, the same load asks for no more
    than the first decision's recommendation (and for nothing more at all when the first step
    reached it); a queue that grew meanwhile asks for at most what the grown load recommends."""
    policy = dataclasses.replace(policy, startup_timeout_seconds=600)
    fleet = [PodObservation(f"p{i}", True, 1000, False, PodMetrics(kv, float(waiting), 1.0))
             for i in range(n_ready)]
    first = decide(policy, n_ready, fleet, History((), NOW - 5000), NOW)
    assume(first.desired_replicas > n_ready)
    on_the_way = [PodObservation(f"s{i}", False, age) for i in range(first.desired_replicas - n_ready)]
    same = decide(policy, first.desired_replicas, fleet + on_the_way, first.history, NOW + 15)
    assert same.desired_replicas <= first.recommendation
    if first.desired_replicas == first.recommendation and first.code in ("KVCacheUsageHigh",
                                                                         "QueueLengthHigh"):
        # The first step reached what the load asks for: the starting pods cover it. (WithinTarget when
        # the same load spread over the new size falls inside the tolerance band: no change either.)
        assert not same.changed and same.code in ("ReplicasStarting", "ScalingLimited", "WithinTarget"), same.reason


def _counted(policy: AutoscalingPolicy, observed: list[PodObservation]) -> tuple[int, int]:
    """(Ready, starting) as the policy defines them."""
    n_ready = sum(p.ready for p in observed)
    n_starting = sum(1 for p in observed if not p.ready and not p.crashing
                     and p.age_seconds <= policy.startup_timeout_seconds)
    return n_ready, n_starting


@settings(max_examples=400, deadline=None)
@given(policies(), st.integers(0, 20), pods, histories())
def test_ready_plus_starting_covering_the_recommendation_never_scales_up(policy, current, observed,
                                                                        history):
    """When replicas are starting and Ready + starting already cover the recommendation r, nothing is added
    (with none starting there is nothing to wait for: r is applied as usual)."""
    current = max(policy.min_replicas, min(policy.max_replicas, current))
    d = decide(policy, current, observed, history, NOW)
    n_ready, n_starting = _counted(policy, observed)
    if n_starting and d.recommendation is not None and d.recommendation <= n_ready + n_starting:
        assert d.desired_replicas <= current, d.reason


loaded_fleets = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3),
                                   ready=st.just(True), age_seconds=st.just(1000.0),
                                   metrics=st.builds(PodMetrics, kv_cache_usage=st.floats(0.5, 1),
                                                     num_requests_waiting=st.integers(0, 200).map(float),
                                                     num_requests_running=st.just(1.0))),
                         min_size=1, max_size=8)
not_ready = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3), ready=st.just(False),
                               age_seconds=st.floats(0, 2000), crashing=st.booleans()), max_size=4)


@settings(max_examples=400, deadline=None)
@given(policies(), st.integers(0, 20), loaded_fleets, not_ready, histories())
def test_a_recommendation_above_current_and_ready_plus_starting_is_applied(policy, current, fleet, others,
                                                                          history):
    """r > current and r > Ready + starting: the new size is r, step-limited (clamped to
    maxReplicas through r), whatever the starting pods; starting pods counted are named."""
    policy = dataclasses.replace(policy, scale_up_stabilization_seconds=0)
    current = max(policy.min_replicas, min(policy.max_replicas, current))
    observed = fleet + others
    d = decide(policy, current, observed, history, NOW)
    n_ready, n_starting = _counted(policy, observed)
    assume(d.recommendation is not None and d.recommendation > max(current, n_ready + n_starting))
    assert d.desired_replicas == min(d.recommendation, max(2 * current, current + 1)) <= policy.max_replicas
    assert d.starting == n_starting
    assert (f"{n_starting} starting counted" in d.reason) == (n_starting > 0)


def _demand_fleet(demand: float, replicas: int, target: float) -> list[PodObservation]:
    """`replicas` Ready pods sharing `demand` (in units of one replica's KV cache)."""
    kv = min(1.0, demand / replicas)
    return [PodObservation(f"p{i}", True, 1000, False, PodMetrics(kv, 0.0, 1.0))
            for i in range(replicas)]


@settings(max_examples=150, deadline=None)
@given(policies(), st.lists(st.floats(0.0, 6.0), min_size=2, max_size=6), st.floats(0.0, 0.5),
       st.integers(20, 60))
def test_oscillating_load_causes_no_scale_down_flapping(policy, highs, low, steps):
    """Load alternating high/low faster than the scale-down window: once scaled up, no scale-down."""
    policy = dataclasses.replace(policy, scale_down_stabilization_seconds=300,
                                 scale_up_stabilization_seconds=0)
    interval, period = 15.0, 8  # high every 8 ticks = 120 s < 300 s
    peak = max(highs)
    current, history, t = policy.min_replicas, History(), NOW
    events = []
    for k in range(steps):
        demand = highs[(k // period) % len(highs)] if k % period < period // 2 else low
        demand = max(demand, peak * 0.999) if k % period == 0 else demand  # peak recurs each period
        d = decide(policy, current, _demand_fleet(demand, current, policy.target_kv_cache_usage),
                   history, t)
        if d.changed:
            events.append(d.direction)
        current, history, t = d.desired_replicas, d.history, t + interval
    # Flapping = a scale-down followed by a scale-up. Never happens.
    for a, b in zip(events, events[1:]):
        assert not (a == "down" and b == "up"), events


full_metrics = st.builds(PodMetrics, kv_cache_usage=st.floats(0, 1),
                        num_requests_waiting=st.integers(0, 200).map(float),
                        num_requests_running=st.integers(0, 64).map(float))
readable_fleets = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3),
                                     ready=st.just(True), age_seconds=st.floats(0, 2000),
                                     metrics=full_metrics), min_size=1, max_size=10)


# Loads around the targets (both scale-up and scale-down regimes are common).
light_fleets = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3),
                                  ready=st.just(True), age_seconds=st.floats(0, 2000),
                                  metrics=st.builds(PodMetrics, kv_cache_usage=st.floats(0, 1),
                                                    num_requests_waiting=st.integers(0, 12).map(float),
                                                    num_requests_running=st.just(1.0))),
                        min_size=1, max_size=10)


@settings(max_examples=400, deadline=None)
@given(policies(), st.integers(0, 20), st.one_of(readable_fleets, light_fleets), pods, histories(), st.data())
def test_missing_data_is_never_read_as_zero_or_full(policy, current, fleet, others, history, data):
    """Pods whose scrape failed: the decision lies between "they are idle" and "they are full";
    more than half of the Ready pods unreadable holds the size."""
    current = max(policy.min_replicas, min(policy.max_replicas, current))
    observed = fleet + [p for p in others if not p.ready]
    lost = set(data.draw(st.lists(st.sampled_from(range(len(fleet))), unique=True)))

    def replaced(m: PodMetrics | None) -> list[PodObservation]:
        return [dataclasses.replace(p, metrics=m) if i in lost else p for i, p in enumerate(fleet)] \
            + observed[len(fleet):]
    d_missing = decide(policy, current, replaced(None), history, NOW)
    if len(lost) > len(fleet) / 2:
        assert d_missing.desired_replicas == current and d_missing.holds
        return
    d_zero = decide(policy, current, replaced(PodMetrics(0.0, 0.0, 0.0)), history, NOW)
    d_full = decide(policy, current, replaced(PodMetrics(1.0, 1000.0, 64.0)), history, NOW)
    assert d_zero.desired_replicas <= d_missing.desired_replicas <= d_full.desired_replicas
    # Strictly: on a scale-down, every unreadable pod keeps its replica on top of what the same
    # readable pods would need if the unreadable ones were idle (HPA: missing metrics never
    # cause a scale-down). Where the idle reading is clamped up to minReplicas it is no measure.
    if policy.min_replicas < d_zero.recommendation < current:
        assert d_missing.recommendation >= min(current, d_zero.recommendation + len(lost)), \
            (d_zero.reason, d_missing.reason)


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(0, 20), readable_fleets, pods, histories(), st.data())
def test_missing_data_never_scales_down(policy, current, fleet, others, history, data):
    """When what can be read calls for no scale-down, unreadable pods never cause one."""
    current = max(policy.min_replicas, min(policy.max_replicas, current))
    # Every readable pod at or above both targets.
    fleet = [dataclasses.replace(p, metrics=PodMetrics(
        max(p.metrics.kv_cache_usage, policy.target_kv_cache_usage),
        max(p.metrics.num_requests_waiting, policy.target_queue_length), 1.0)) for p in fleet]
    lost = set(data.draw(st.lists(st.sampled_from(range(len(fleet))), unique=True)))
    observed = [dataclasses.replace(p, metrics=None) if i in lost else p for i, p in enumerate(fleet)]
    observed += [p for p in others if not p.ready]
    d = decide(policy, current, observed, history, NOW)
    assert d.desired_replicas >= current


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(1, 6), st.integers(1, 6), st.integers(0, 30), st.data())
def test_unreadable_pods_keep_their_replicas_on_scale_down(policy, n_idle, n_lost, extra, data):
    """Idle readable pods and unreadable ones (at most half): a scale-down keeps exactly one
    replica per unreadable pod — never fewer (they are not idle), never more (the idle ones go)."""
    assume(n_lost <= (n_idle + n_lost) / 2)
    policy = dataclasses.replace(policy, scale_down_stabilization_seconds=0,
                                 max_replicas=max(policy.max_replicas, n_idle + n_lost + extra))
    current = n_idle + n_lost + extra
    idle = [PodObservation(f"i{k}", True, 1000, False, PodMetrics(0.0, 0.0, 0.0)) for k in range(n_idle)]
    lost = [PodObservation(f"u{k}", True, 1000, False, None) for k in range(n_lost)]
    order = data.draw(st.permutations(idle + lost))
    d = decide(policy, current, order, History((), NOW - 5000), NOW)
    assert d.desired_replicas == max(policy.min_replicas, n_lost), d.reason


@settings(max_examples=400, deadline=None)
@given(policies(), st.integers(0, 20), pods, histories(), st.floats(0, 1), st.integers(0, 100))
def test_recommendation_never_falls_when_load_rises(policy, current, observed, history, dkv, dq):
    """Raising any Ready pod's KV usage or queue never lowers the recommendation or the decision."""
    before = decide(policy, current, observed, history, NOW)

    def more(m: PodMetrics | None) -> PodMetrics | None:
        if m is None:
            return None
        return PodMetrics(None if m.kv_cache_usage is None else min(1.0, m.kv_cache_usage + dkv),
                          None if m.num_requests_waiting is None else m.num_requests_waiting + dq,
                          m.num_requests_running)
    loaded = [dataclasses.replace(p, metrics=more(p.metrics)) for p in observed]
    after = decide(policy, current, loaded, history, NOW)
    assert after.desired_replicas >= before.desired_replicas
    if before.recommendation is not None and after.recommendation is not None:
        assert after.recommendation >= before.recommendation


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(0, 20), light_fleets, pods, histories(), st.data())
def test_an_unreadable_pod_is_never_assumed_lighter_than_the_readable_ones(policy, current, fleet, others,
                                                                          history, data):
    """A pod whose scrape failed counts at least as much as a pod carrying the readable pods' mean
    load (scaling up extrapolates the mean to it, scaling down keeps its replica)."""
    observed_others = [p for p in others if not p.ready]
    lost = set(data.draw(st.lists(st.sampled_from(range(len(fleet))), unique=True)))
    assume(len(lost) <= len(fleet) / 2)
    kept = [p.metrics for i, p in enumerate(fleet) if i not in lost]
    mean = PodMetrics(sum(m.kv_cache_usage for m in kept) / len(kept),
                      sum(m.num_requests_waiting for m in kept) / len(kept), 1.0)

    def replaced(m: PodMetrics | None) -> list[PodObservation]:
        return [dataclasses.replace(p, metrics=m) if i in lost else p
                for i, p in enumerate(fleet)] + observed_others
    d_missing = decide(policy, current, replaced(None), history, NOW)
    d_mean = decide(policy, current, replaced(mean), history, NOW)
    assert d_mean.desired_replicas <= d_missing.desired_replicas
    if d_mean.recommendation is not None and d_missing.recommendation is not None:
        assert d_mean.recommendation <= d_missing.recommendation


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(1, 16), st.floats(0.0, 0.95), st.floats(0.0, 0.95))
def test_after_a_scale_down_the_same_load_plus_band_noise_asks_for_no_scale_up(policy, n, kv_ratio,
                                                                               q_ratio):
    """Hysteresis: a scale-down lands where the load sits at the band's lower edge, so the same
    total load on the smaller fleet may grow by (1 + tol)/(1 - tol) before a scale-up."""
    policy = dataclasses.replace(policy, scale_down_stabilization_seconds=0,
                                 scale_up_stabilization_seconds=0)
    n = max(policy.min_replicas, min(policy.max_replicas, n))
    kv, waiting = kv_ratio * policy.target_kv_cache_usage, q_ratio * policy.target_queue_length
    fleet = [PodObservation(f"p{i}", True, 1000, False, PodMetrics(kv, waiting, 1.0))
             for i in range(n)]
    d = decide(policy, n, fleet, History((), NOW - 5000), NOW)
    assume(d.direction == "down")
    m = d.desired_replicas
    grow = (1 + policy.tolerance) / (1 - policy.tolerance) * 0.999
    after = [PodObservation(f"p{i}", True, 1000, False,
                            PodMetrics(min(1.0, kv * n / m * grow), waiting * n / m * grow, 1.0))
             for i in range(m)]
    d2 = decide(policy, m, after, d.history, NOW + 15)
    assert d2.direction != "up", (d.reason, d2.reason)


any_float = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))
wild_pods = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=3),
                               ready=st.booleans(), age_seconds=st.floats(0, 2000),
                               crashing=st.booleans(),
                               metrics=st.one_of(st.none(), st.builds(PodMetrics, any_float, any_float,
                                                                      any_float))),
                     max_size=8)


@settings(max_examples=300, deadline=None)
@given(policies(), st.integers(0, 20), wild_pods, histories(), st.floats(NOW - 1000, NOW + 1000))
def test_any_samples_and_any_clock_give_a_bounded_decision(policy, current, observed, history, now):
    """Broken exporters (NaN, ±inf, negative, KV > 1) and a clock that moved either way never make
    decide() raise, and the result stays within bounds with a finite reported KV mean."""
    d = decide(policy, current, observed, history, now)
    assert policy.min_replicas <= d.desired_replicas <= policy.max_replicas
    assert d.kv_cache_usage is None or 0.0 <= d.kv_cache_usage <= 1.0
    assert d.waiting_per_replica is None or d.waiting_per_replica >= 0.0
    assert all(r.at <= now for r in d.history.recommendations)
