"""The autoscaler's pure glue: how Pod objects become policy observations, and the Event shape;
plus a smoke run of the trace-driven simulation on a short trace."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

import pytest

from kvfleet_operator.autoscale import AutoscalingPolicy
from kvfleet_operator.autoscaler import _event, observe_pod

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def pod(phase="Running", ready=True, restarts=0, waiting=None, terminated=False, created="2026-01-01T11:59:00Z",
        started=None):
    state = {"waiting": {"reason": waiting}} if waiting else {"terminated": {"exitCode": 1}} if terminated \
        else {"running": {}}
    return {"metadata": {"name": "p", "creationTimestamp": created},
            "status": {"phase": phase,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "c", "ready": ready, "restartCount": restarts,
                                              "image": "i", "imageID": "x", "state": state,
                                              "started": ready if started is None else started}]}}


@pytest.mark.parametrize("obj,ready,crashing", [
    (pod(), True, False),
    (pod(ready=False), False, False),  # loading weights: starting
    (pod(phase="Pending", ready=False, waiting="ContainerCreating"), False, False),  # pulling image
    (pod(ready=False, restarts=3, waiting="CrashLoopBackOff"), False, True),
    (pod(ready=False, restarts=1), False, True),  # restarted once (startup probe killed it)
    (pod(phase="Pending", ready=False, waiting="ImagePullBackOff"), False, True),
    (pod(ready=False, terminated=True), False, True),
    (pod(phase="Failed", ready=False), False, True),
    (pod(ready=True, restarts=2), True, False),  # recovered and Ready: counts as Ready
    # Passed its startup probe, then lost readiness (overloaded or broken engine): not on its way,
    # so it does not hold scale-ups for up to startupTimeoutSeconds.
    (pod(ready=False, started=True), False, True),
])
def test_observe_pod_classifies_ready_starting_crashing(obj, ready, crashing):
    o = observe_pod(obj, NOW)
    assert (o.ready, o.crashing) == (ready, crashing)
    assert o.age_seconds == 60.0 and o.metrics is None


def test_observe_pod_without_creation_time_is_young():
    obj = pod(ready=False)
    del obj["metadata"]["creationTimestamp"]
    assert observe_pod(obj, NOW).age_seconds == 0.0


def test_event_names_the_inference_service():
    obj = {"metadata": {"name": "chat", "namespace": "team", "uid": "u-1"}}
    ev = _event(obj, "Normal", "ScaledUp", "scaled 2→4: kv cache usage 0.93 > target 0.80", "2026-01-01T00:00:00Z")
    assert ev["involvedObject"] == {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
                                    "name": "chat", "namespace": "team", "uid": "u-1"}
    assert ev["metadata"]["namespace"] == "team" and ev["metadata"]["name"].startswith("chat.")
    assert ev["type"] == "Normal" and ev["reason"] == "ScaledUp" and ev["message"].startswith("scaled 2→4")


def _load_sim():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscale_sim.py"
    spec = importlib.util.spec_from_file_location("autoscale_sim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["autoscale_sim"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_simulation_smoke_conserves_requests_and_respects_bounds():
    sim = _load_sim()
    fig = dict(sim.MEASURED_FIGURES)
    scale = 0.025 / fig["step_fit_seconds"]["a"]
    fig["step_fit_seconds"] = {k: v * scale for k, v in fig["step_fit_seconds"].items()}
    fig["prefill_seconds_per_token"] *= scale
    hours = 1.5
    trace = sim.make_trace(hours * 3600, 40.0, 1, 1000, 256)
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=6)
    auto = sim.simulate("kvfleet", trace, fig, policy=policy, initial=1, startup_s=60, dt=1.0, queue_only=False)
    assert len(auto.queue_delays) == sim.make_trace(hours * 3600, 40.0, 1, 1000, 256).arrival.size
    assert 1 <= auto.peak_replicas <= 6 + 6  # + replicas still draining after a scale-down
    assert auto.scale_ups >= 1
    fixed = sim.simulate("fixed", sim.make_trace(hours * 3600, 40.0, 1, 1000, 256), fig, policy=None,
                         initial=3, startup_s=60, dt=1.0, queue_only=False)
    assert fixed.scale_events == 0
    assert fixed.peak_replicas == 3 and fixed.replica_hours >= 3 * hours * 0.99  # plus the final drain


def test_simulation_models_victims_drain_cuts_and_the_first_pass_hold():
    sim = _load_sim()
    fig = dict(sim.MEASURED_FIGURES)
    scale = 0.025 / fig["step_fit_seconds"]["a"]
    fig["step_fit_seconds"] = {k: v * scale for k, v in fig["step_fit_seconds"].items()}
    fig["prefill_seconds_per_token"] *= scale
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=6, scale_down_stabilization_seconds=60)
    args = (1.0 * 3600, 40.0, 2, 1000, 256)
    n = sim.make_trace(*args).arrival.size
    runs = {v: sim.simulate(v, sim.make_trace(*args), fig, policy=policy, initial=1, startup_s=60, dt=1.0,
                            queue_only=False, victim=v, drain_timeout_s=2.0) for v in ("drain-aware", "random")}
    for r in runs.values():
        assert len(r.queue_delays) == n  # cut requests are still counted (queued until the cut)
        assert r.victims >= 1 and r.drain_seconds > 0
    with pytest.raises(ValueError, match="victim"):
        sim.simulate("x", sim.make_trace(*args), fig, policy=policy, initial=1, startup_s=60, dt=1.0,
                     queue_only=False, victim="oldest")

    from kvfleet_operator.autoscale import History, PodMetrics, PodObservation, decide
    pods = [PodObservation("a", True, 1000, False, PodMetrics(0.5, 20.0, 1.0)),
            PodObservation("s", False, 10)]
    d = decide(policy, 2, pods, History((), -1e4), 0.0)
    assert d.direction == "up" and d.starting == 1  # counted, still scales: ceil(1 × 4) = 4 > 1 + 1
    held = sim.first_pass_hold(d, policy)
    assert held.desired_replicas == 2 and not held.changed and held.code == "ReplicasStarting"
