"""Drain-aware scale-down: pod-deletion-cost values (pure) and what a scale-down tick writes
(kvfleet_operator.autoscaler.tick against KMock's API-server emulator, every write checked)."""

from __future__ import annotations

import dataclasses
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from kmock_support import OPERATOR_TOKEN
from kvfleet_operator import api as isvc_api
from kvfleet_operator import autoscaler
from kvfleet_operator.autoscale import PodMetrics, PodObservation
from kvfleet_operator.autoscaler import AutoscalerState, tick
from kvfleet_operator.deletion_cost import ANNOTATION, deletion_costs
from kvfleet_operator.scrape import ScrapeResult, parse_metrics

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
LOG = logging.getLogger("test")
LABELS = {"app.kubernetes.io/name": "kvfleet-server", "app.kubernetes.io/instance": "svc"}


def ready(name, running=0.0, waiting=0.0, cached=None, kv=0.1):
    return PodObservation(name, True, 1000, False, PodMetrics(kv, waiting, running, cached))


def test_costs_order_pods_by_load_then_cached_blocks():
    costs = deletion_costs([
        ready("busy", running=12, waiting=3),
        ready("warm", running=1, cached=300),
        ready("cold", running=1, cached=2),
        ready("idle"),
        PodObservation("starting", False, 30),
        PodObservation("crashing", False, 30, crashing=True),
    ])
    assert costs == {"starting": 0, "crashing": 0, "idle": 1, "cold": 2, "warm": 3, "busy": 4}


def test_without_cached_blocks_kv_usage_breaks_ties():
    """A vLLM server exports no kvfleet:kv_cache_blocks_cached: KV usage breaks the tie."""
    costs = deletion_costs([ready("a", running=2, kv=0.7), ready("b", running=2, kv=0.2)])
    assert costs == {"b": 1, "a": 2}


def test_an_unreadable_ready_pod_is_ranked_at_the_mean_load():
    """Neither first to go (it may be overloaded: its /metrics timed out) nor kept at a stale high."""
    costs = deletion_costs([ready("a", running=10), ready("b", running=0),
                            PodObservation("lost", True, 1000, False, None)])
    assert costs == {"b": 1, "lost": 2, "a": 3}


ready_pods = st.lists(st.builds(PodObservation, name=st.text(min_size=1, max_size=4), ready=st.booleans(),
                                age_seconds=st.just(100.0), crashing=st.booleans(),
                                metrics=st.one_of(st.none(), st.builds(
                                    PodMetrics, st.floats(0, 1), st.integers(0, 50).map(float),
                                    st.integers(0, 50).map(float),
                                    st.one_of(st.none(), st.integers(0, 500).map(float))))),
                      max_size=10, unique_by=lambda p: p.name)


@settings(max_examples=300, deadline=None)
@given(ready_pods)
def test_costs_are_ranks_not_ready_lowest_and_less_load_never_costs_more(pods):
    costs = deletion_costs(pods)
    assert set(costs) == {p.name for p in pods}
    n_ready = sum(p.ready for p in pods)
    assert sorted(costs[p.name] for p in pods if p.ready) == list(range(1, n_ready + 1))
    assert all(costs[p.name] == 0 for p in pods if not p.ready)
    scraped = [p for p in pods if p.ready and p.metrics is not None]
    for p in scraped:
        for q in scraped:
            if p.metrics.num_requests_running + p.metrics.num_requests_waiting < \
                    q.metrics.num_requests_running + q.metrics.num_requests_waiting:
                assert costs[p.name] < costs[q.name]


def test_scrape_reads_cached_blocks():
    text = ("# TYPE kvfleet:kv_cache_blocks_cached gauge\n"
            'kvfleet:kv_cache_blocks_cached{model_name="m",engine="0"} 42.0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n')
    m = parse_metrics(text)
    assert m.kv_cache_blocks_cached == 42.0 and m.num_requests_running == 3.0
    assert parse_metrics(text.replace("42.0", "-1.0")).kv_cache_blocks_cached is None


# ------------------------------------------------------------------ a scale-down tick, every write
def _pod(name: str, ready: bool) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": LABELS},
            "spec": {"containers": [{"name": "s", "ports": [{"name": "http", "containerPort": 1}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "s", "ready": ready, "started": ready, "restartCount": 0,
                                              "image": "i", "imageID": "x", "state": {"running": {}}}]}}


async def _setup(api, ready_names, starting_names) -> dict:
    obj = await api.create(AV, PL, "default", {
        "apiVersion": AV, "kind": isvc_api.KIND, "metadata": {"name": "svc", "namespace": "default"},
        "spec": {"model": {"uri": "hf://org/m"},
                 "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 8,
                                 "scaleDownStabilizationSeconds": 0}}})
    owner = {"apiVersion": AV, "kind": isvc_api.KIND, "name": "svc", "controller": True,
             "uid": obj["metadata"]["uid"]}
    await api.create("apps/v1", "deployments", "default", {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "svc", "namespace": "default", "ownerReferences": [owner]},
        "spec": {"replicas": len(ready_names) + len(starting_names), "selector": {"matchLabels": LABELS},
                 "template": {"metadata": {"labels": LABELS}, "spec": {"containers": []}}}})
    for n in ready_names:
        await api.create("v1", "pods", "default", _pod(n, True))
    for n in starting_names:
        await api.create("v1", "pods", "default", _pod(n, False))
    return await api.get(AV, PL, "default", "svc")


async def _costs(api) -> dict[str, str | None]:
    return {p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(ANNOTATION)
            for p in await api.list("v1", "pods", "default")}


def _check_every_write(writes: list[dict]) -> list[str]:
    """Each operator write of a tick is one of: a pod's deletion-cost annotation, the Deployment's
    replicas, the InferenceService's status, an Event. Returns the written pods in order."""
    ours = [w for w in writes if w["auth"] == f"Bearer {OPERATOR_TOKEN}"]
    assert ours
    order = []
    for w in ours:
        if w["resource"] == "pods":
            assert w["method"] == "PATCH" and w["subresource"] is None, w
            assert w["data"] == {"metadata": {"annotations": {ANNOTATION: w["data"]["metadata"]["annotations"][ANNOTATION]}}}, w
            int(w["data"]["metadata"]["annotations"][ANNOTATION])
            order.append(w["name"])
        elif w["resource"] == "deployments":
            assert w["method"] == "PATCH" and w["subresource"] is None, w
            assert set(w["data"]) == {"spec"} and set(w["data"]["spec"]) == {"replicas"}, w
            order.append("<replicas>")
        elif w["resource"] == PL:
            assert w["method"] == "PATCH" and w["subresource"] == "status" and set(w["data"]) == {"status"}, w
        else:
            assert w["resource"] == "events" and w["method"] == "POST", w
    return order


async def test_scale_down_sets_ordered_costs_first_and_refreshes_them(api, emulator, monkeypatch):
    scraped: dict[str, PodMetrics | None] = {
        "svc-busy": PodMetrics(0.45, 0.0, 14.0, 40.0), "svc-some": PodMetrics(0.45, 0.0, 5.0, 10.0),
        "svc-idle": PodMetrics(0.45, 0.0, 0.0, 90.0), "svc-cold": PodMetrics(0.45, 0.0, 0.0, 3.0)}

    async def scrape(targets, timeout):
        return [ScrapeResult(t.name, scraped[t.name]) if scraped[t.name] else
                ScrapeResult(t.name, None, "timed out after 2s") for t in targets]
    monkeypatch.setattr(autoscaler, "scrape_all", scrape)
    obj = await _setup(api, list(scraped), ["svc-new"])
    # From here the client acts as the operator (its token): every write is checked.
    api.info = dataclasses.replace(api.info, token=OPERATOR_TOKEN)
    before = len(emulator.writes)

    # KV 0.45 vs target 0.8 on 4 Ready pods: ceil(4 × 0.5625 / 0.9) = 3 -> 5 asked-for go to 3.
    d = await tick(obj, AutoscalerState(clock=lambda: 1000.0), api, LOG)
    assert d.direction == "down" and d.desired_replicas == 3
    assert await _costs(api) == {"svc-new": "0", "svc-cold": "1", "svc-idle": "2", "svc-some": "3",
                                 "svc-busy": "4"}
    order = _check_every_write(emulator.writes[before:])
    assert order[-1] == "<replicas>" and len(order) == 6  # all five costs, then the replicas

    # The ReplicaSet removed the two lowest; the busy pod's /metrics now times out. At the next
    # scale-down its cost is refreshed (mean load of the scraped pods), not left at the top.
    await api.delete("v1", "pods", "default", "svc-new")
    await api.delete("v1", "pods", "default", "svc-cold")
    scraped.update({"svc-busy": None, "svc-some": PodMetrics(0.05, 0.0, 5.0), "svc-idle": PodMetrics(0.05, 0.0, 0.0)})
    obj = await api.get(AV, PL, "default", "svc")
    before = len(emulator.writes)
    d = await tick(obj, AutoscalerState(clock=lambda: 2000.0), api, LOG)
    assert d.direction == "down" and d.desired_replicas == 2  # 1 for the readable pair + 1 unreadable kept
    assert await _costs(api) == {"svc-idle": "1", "svc-busy": "2", "svc-some": "3"}
    order = _check_every_write(emulator.writes[before:])
    assert sorted(order[:-1]) == ["svc-busy", "svc-idle"] and order[-1] == "<replicas>"  # changed values only

    # A scale-up writes no pod.
    scraped.update({"svc-some": PodMetrics(1.0, 20.0, 5.0), "svc-idle": PodMetrics(1.0, 20.0, 0.0)})
    before = len(emulator.writes)
    d = await tick(await api.get(AV, PL, "default", "svc"), AutoscalerState(clock=lambda: 3000.0), api, LOG)
    assert d.direction == "up"
    assert "<replicas>" in _check_every_write(emulator.writes[before:])
    assert not [w for w in emulator.writes[before:] if w["resource"] == "pods"]


async def test_terminating_pods_are_neither_capacity_nor_load_nor_given_costs(api, emulator, monkeypatch):
    """Issue 34: a pod with metadata.deletionTimestamp (draining after a scale-down or a rollout) is
    ignored by the autoscaler. Three idle Ready pods and one terminating pod that is still Ready and
    still busy: the decision sees only the three (and scales down), and only they get a deletion cost.
    Counting the terminating pod would make it capacity (4 Ready) and load (20 waiting requests: a
    queue of 5 per replica, at target) — no scale-down — and give a dying pod a cost."""
    scraped = {"svc-0": PodMetrics(0.05, 0.0, 0.0), "svc-1": PodMetrics(0.05, 0.0, 1.0),
               "svc-2": PodMetrics(0.05, 0.0, 0.0), "svc-leaving": PodMetrics(0.99, 20.0, 8.0)}

    async def scrape(targets, timeout):
        return [ScrapeResult(t.name, scraped[t.name]) for t in targets]
    monkeypatch.setattr(autoscaler, "scrape_all", scrape)
    seen = []
    real_decide = autoscaler.decide

    def spy(policy, current, observed, history, now):
        seen.append(sorted(o.name for o in observed))
        return real_decide(policy, current, observed, history, now)
    monkeypatch.setattr(autoscaler, "decide", spy)
    obj = await _setup(api, ["svc-0", "svc-1", "svc-2"], [])
    leaving = _pod("svc-leaving", True)
    leaving["metadata"].update(deletionTimestamp="2026-12-01T00:00:00Z", finalizers=["example.com/drain"])
    await api.create("v1", "pods", "default", leaving)
    assert (await api.get("v1", "pods", "default", "svc-leaving"))["metadata"]["deletionTimestamp"]
    api.info = dataclasses.replace(api.info, token=OPERATOR_TOKEN)
    before = len(emulator.writes)

    d = await tick(obj, AutoscalerState(clock=lambda: 1000.0), api, LOG)
    assert seen == [["svc-0", "svc-1", "svc-2"]]
    assert d.ready == 3 and d.readable == 3 and d.direction == "down" and d.desired_replicas == 1
    assert (await api.get(AV, PL, "default", "svc"))["status"]["autoscaling"]["scrapedPods"] == 3
    costs = await _costs(api)
    assert costs == {"svc-0": "1", "svc-2": "2", "svc-1": "3", "svc-leaving": None}
    assert "svc-leaving" not in _check_every_write(emulator.writes[before:])
