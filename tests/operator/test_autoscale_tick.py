"""One autoscaler tick (kvfleet_operator.autoscaler.tick) against KMock's API-server emulator,
without the kopf runtime: deterministic checks of what a tick reads and writes."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvfleet_operator import api as isvc_api
from kvfleet_operator import autoscaler
from kvfleet_operator.autoscaler import AutoscalerState, tick
from kvfleet_operator.scrape import ScrapeResult

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
LOG = logging.getLogger("test")
LABELS = {"app.kubernetes.io/name": "kvfleet-server", "app.kubernetes.io/instance": "svc"}


@pytest.fixture()
def endpoint():
    r = CollectorRegistry()
    g = {n: Gauge(n, n, ["model_name", "engine"], registry=r).labels("m", "0")
         for n in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running")}
    g["vllm:kv_cache_usage_perc"].set(0.99)
    g["vllm:num_requests_waiting"].set(2)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=r)
    yield server.server_port
    server.shutdown()
    server.server_close()


async def _setup(api, port: int, replicas: int = 2, controlled: bool = True, autoscaling=None) -> dict:
    obj = await api.create(AV, PL, "default", {
        "apiVersion": AV, "kind": isvc_api.KIND, "metadata": {"name": "svc", "namespace": "default"},
        "spec": {"model": {"uri": "hf://org/m"},
                 "autoscaling": autoscaling or {"enabled": True, "minReplicas": 1, "maxReplicas": 6}}})
    owner = {"apiVersion": AV, "kind": isvc_api.KIND, "name": "svc", "controller": True,
             "uid": obj["metadata"]["uid"] if controlled else "someone-else"}
    await api.create("apps/v1", "deployments", "default", {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "svc", "namespace": "default", "ownerReferences": [owner]},
        "spec": {"replicas": replicas, "selector": {"matchLabels": LABELS},
                 "template": {"metadata": {"labels": LABELS}, "spec": {"containers": []}}}})
    for i in range(replicas):
        await api.create("v1", "pods", "default", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"svc-{i}", "namespace": "default", "labels": LABELS},
            "spec": {"containers": [{"name": "s", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "s", "ready": True, "restartCount": 0,
                                              "image": "i", "imageID": "x", "state": {"running": {}}}]}})
    # An unrelated pod in the namespace is never counted.
    await api.create("v1", "pods", "default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other", "namespace": "default",
                                                        "labels": {"app": "other"}},
        "spec": {"containers": []}, "status": {"phase": "Running", "podIP": "127.0.0.1"}})
    return await api.get(AV, PL, "default", "svc")


async def test_tick_scales_writes_status_and_event(api, emulator, endpoint):
    obj = await _setup(api, endpoint)
    state = AutoscalerState(clock=lambda: 1000.0)
    d = await tick(obj, state, api, LOG)
    # ceil(2 × 0.99 / 0.8) = 3.
    assert d.changed and d.desired_replicas == 3 and d.code == "KVCacheUsageHigh" and d.ready == 2
    assert (await api.get("apps/v1", "deployments", "default", "svc"))["spec"]["replicas"] == 3
    status = (await api.get(AV, PL, "default", "svc"))["status"]
    assert status["desiredReplicas"] == 3
    auto = status["autoscaling"]
    assert auto["message"] == "scaled 2→3: kv cache usage 0.99 > target 0.80"
    assert auto["kvCacheUsage"] == 0.99 and auto["waitingRequests"] == 4 and auto["scrapedPods"] == 2
    assert auto["lastScaleTime"] and auto["recommendation"] == 3
    (event,) = [e for e in await api.list("v1", "events", "default")]
    assert event["reason"] == "ScaledUp" and event["message"] == auto["message"]
    assert state.history.recommendations  # remembered for the next tick


async def test_tick_drops_decision_when_replicas_change_during_scrape(api, emulator, endpoint, monkeypatch):
    obj = await _setup(api, endpoint)
    real = autoscaler.scrape_all

    async def scrape_while_user_scales(targets, timeout):
        await api.patch("apps/v1", "deployments", "default", "svc", {"spec": {"replicas": 5}})
        return await real(targets, timeout=timeout)
    monkeypatch.setattr(autoscaler, "scrape_all", scrape_while_user_scales)
    state = AutoscalerState(clock=lambda: 1000.0)
    assert await tick(obj, state, api, LOG) is None
    assert (await api.get("apps/v1", "deployments", "default", "svc"))["spec"]["replicas"] == 5
    assert state.history.recommendations == ()
    assert not [e for e in await api.list("v1", "events", "default")]


async def test_tick_skips_a_deployment_it_does_not_control(api, emulator, endpoint):
    obj = await _setup(api, endpoint, controlled=False)
    before = len(emulator.writes)
    assert await tick(obj, AutoscalerState(), api, LOG) is None
    assert len(emulator.writes) == before


async def test_tick_holds_when_scrapes_fail_and_refuses_bad_spec(api, emulator, endpoint, monkeypatch):
    obj = await _setup(api, endpoint)

    async def all_fail(targets, timeout):
        return [ScrapeResult(t.name, None, "connection refused") for t in targets]
    monkeypatch.setattr(autoscaler, "scrape_all", all_fail)
    d = await tick(obj, AutoscalerState(), api, LOG)
    assert not d.changed and d.code == "MetricsUnavailable"
    auto = (await api.get(AV, PL, "default", "svc"))["status"]["autoscaling"]
    assert auto["reason"] == "MetricsUnavailable" and "2 of 2 Ready pods unreadable" in auto["message"]
    (warning,) = await api.list("v1", "events", "default")
    assert warning["type"] == "Warning"

    bad = dict(obj, spec={**obj["spec"], "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}})
    with pytest.raises(ValueError, match="minReplicas"):
        await tick(bad, AutoscalerState(), api, LOG)



async def test_after_a_restart_a_quiet_service_scales_down_one_window_later(api, emulator, monkeypatch):
    obj = await _setup(api, 1, replicas=4)

    async def idle(targets, timeout):
        from kvfleet_operator.autoscale import PodMetrics
        return [ScrapeResult(t.name, PodMetrics(0.02, 0.0, 0.0)) for t in targets]
    monkeypatch.setattr(autoscaler, "scrape_all", idle)
    clock = [5000.0]
    state = AutoscalerState(clock=lambda: clock[0])  # a fresh operator: empty history
    for _ in range(20):  # 300 s of 15-s ticks: the unknown past counts as "keep 4"
        d = await tick(obj, state, api, LOG)
        assert d.desired_replicas == 4 and d.code == "ScaleDownStabilizing"
        clock[0] += 15
    d = await tick(obj, state, api, LOG)
    assert d.changed and d.desired_replicas == 1 and d.code == "LoadLow"
    assert (await api.get("apps/v1", "deployments", "default", "svc"))["spec"]["replicas"] == 1


class _Stopped:
    """Stands in for kopf.DaemonStopped: true after `ticks` waits."""

    def __init__(self, ticks: int):
        self.ticks, self.reason = ticks, "test"

    def __bool__(self) -> bool:
        return self.ticks <= 0

    async def wait(self, timeout: float) -> None:
        self.ticks -= 1


async def test_daemon_reports_a_refused_spec_as_invalid_and_survives_other_errors(api, emulator, endpoint,
                                                                                 monkeypatch):
    monkeypatch.setattr(autoscaler.kube, "get_client", lambda: api)
    obj = await _setup(api, endpoint)
    bad = dict(obj, spec={**obj["spec"], "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}})
    await autoscaler.autoscaler_daemon(body=bad, stopped=_Stopped(1), logger=LOG)
    auto = (await api.get(AV, PL, "default", "svc"))["status"]["autoscaling"]
    assert auto["reason"] == "InvalidSpec" and "minReplicas" in auto["message"]

    calls = []

    async def broken_tick(obj, state, client, logger):
        calls.append(state)
        raise ValueError("an unexpected object shape, not the spec")
    monkeypatch.setattr(autoscaler, "tick", broken_tick)
    good = await api.get(AV, PL, "default", "svc")
    await autoscaler.autoscaler_daemon(body=good, stopped=_Stopped(2), logger=LOG)
    assert len(calls) == 2 and calls[0] is calls[1]  # the loop went on, with the same history
    auto = (await api.get(AV, PL, "default", "svc"))["status"]["autoscaling"]
    # Unchanged: the tick's error was not reported as an invalid spec.
    assert auto["reason"] == "InvalidSpec" and "minReplicas" in auto["message"]
    assert "unexpected" not in auto["message"]
