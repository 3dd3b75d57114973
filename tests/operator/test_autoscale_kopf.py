"""End to end: the real kopf runtime (KopfRunner) with the operator's handlers and the autoscaler,
against KMock's API-server emulator; Pod objects point (status.podIP 127.0.0.1 + their declared
containerPort) at real Prometheus exposition servers whose vLLM gauges the test sets."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.registry import Collector

from kmock_support import OPERATOR_TOKEN, assert_operator_never_wrote_spec, running_operator, wait_for
from kvfleet_operator import api as isvc_api

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
MODULES = ("kvfleet_operator.handlers", "kvfleet_operator.autoscaler")


class _ScrapeCounter(Collector):
    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            self.count += 1
        return []


class MetricEndpoint:
    """A real HTTP /metrics server (prometheus_client) with vLLM's autoscaling gauges."""

    def __init__(self):
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._kv = Gauge("vllm:kv_cache_usage_perc", "KV usage", labels, registry=self.registry).labels("smollm2", "0")
        self._waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=self.registry).labels("smollm2", "0")
        self._running = Gauge("vllm:num_requests_running", "running", labels, registry=self.registry).labels("smollm2", "0")
        self.scrapes = _ScrapeCounter()
        self.registry.register(self.scrapes)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self.server.server_port

    def set(self, kv: float, waiting: float, running: float = 1) -> None:
        self._kv.set(kv)
        self._waiting.set(waiting)
        self._running.set(running)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def pod(name: str, labels: dict, port: int, ready: bool) -> dict:
    """A Pod as the kubelet reports it: loopback IP, the server container declaring `port`."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": dict(labels)},
        "spec": {"containers": [{"name": "kvfleet-server", "image": "kvfleet-server:cpu",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]},
        "status": {
            "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Initialized", "status": "True"},
                           {"type": "ContainersReady", "status": "True" if ready else "False"},
                           {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "kvfleet-server", "ready": ready, "started": ready,
                                   "restartCount": 0, "image": "kvfleet-server:cpu",
                                   "imageID": "docker.io/library/kvfleet-server@sha256:" + "0" * 64,
                                   "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}],
        },
    }


def autoscaled(name: str) -> dict:
    obj = yaml.safe_load((SAMPLES / "smollm2-135m-cpu.yaml").read_text())
    obj["metadata"] = {"name": name, "namespace": "default"}
    obj["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 4,
                                  "metricsIntervalSeconds": 1, "scaleDownStabilizationSeconds": 3}
    return obj


async def test_autoscaler_scales_deployment_writes_status_and_events_and_stops_on_delete(api, emulator):
    name = "chat"
    e0, e1 = MetricEndpoint(), MetricEndpoint()
    try:
        async with running_operator(*MODULES):
            created = await api.create(AV, PL, "default", autoscaled(name))
            spec_before = copy.deepcopy(created["spec"])
            dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
            assert dep["spec"]["replicas"] == 1
            labels = dep["spec"]["template"]["metadata"]["labels"]

            async def replicas() -> int:
                return (await api.get("apps/v1", "deployments", "default", name))["spec"]["replicas"]

            async def status() -> dict:
                return (await api.get(AV, PL, "default", name)).get("status") or {}

            # One Ready pod, KV cache nearly full and a queue: 1 -> 2 (ceil(1 × 8/5) = 2).
            e0.set(kv=0.95, waiting=8)
            await api.create("v1", "pods", "default", pod("chat-0", labels, e0.port, ready=True))
            await wait_for(lambda: _eq(replicas, 2), timeout=20)
            st = await wait_for(lambda: _status_with(status, "lastScaleTime"))
            assert st["desiredReplicas"] == 2
            assert st["autoscaling"]["reason"] == "QueueLengthHigh"
            assert st["autoscaling"]["message"].startswith("scaled 1→2: waiting requests 8.0/replica > target 5")
            events = await wait_for(lambda: _events(api, name))
            assert any(ev["message"].startswith("scaled 1→2:") and ev["reason"] == "ScaledUp"
                       and ev["involvedObject"]["uid"] == created["metadata"]["uid"] for ev in events)

            # The new replica is starting: it is counted as capacity, so the same load asks for
            # nothing more (no cascade).
            await api.create("v1", "pods", "default", pod("chat-1", labels, e1.port, ready=False))
            st = await wait_for(lambda: _status_reason(status, "ReplicasStarting"), timeout=20)
            assert "covered by 1 Ready + 1 starting counted (chat-1)" in st["autoscaling"]["message"]
            assert await replicas() == 2

            # It becomes Ready; both pods idle -> back to minReplicas after the (test-short) window.
            e1.set(kv=0.05, waiting=0)
            e0.set(kv=0.05, waiting=0)
            await api.patch("v1", "pods", "default", "chat-1",
                            {"status": pod("chat-1", labels, e1.port, ready=True)["status"]},
                            subresource="status")
            await wait_for(lambda: _eq(replicas, 1), timeout=25)
            st = await wait_for(lambda: _status_reason(status, "LoadLow"))
            assert st["desiredReplicas"] == 1 and st["autoscaling"]["reason"] == "LoadLow"
            assert st["autoscaling"]["scrapedPods"] == 2
            events = await _events(api, name)
            assert any(ev["message"].startswith("scaled 2→1:") and ev["reason"] == "ScaledDown" for ev in events)

            # The user's spec was never written by the operator: not its value, and no write with
            # the operator's credentials that could touch it (/scale, JSON patch, PUT, ...).
            live = await api.get(AV, PL, "default", name)
            assert live["spec"] == spec_before
            assert_operator_never_wrote_spec(emulator.writes)

            # Delete the InferenceService: its loop stops scraping.
            await api.delete(AV, PL, "default", name)
            await wait_for(lambda: _gone(api, name), timeout=20)
            await asyncio.sleep(1.5)  # let a tick that was in flight finish
            before = e0.scrapes.count + e1.scrapes.count
            await asyncio.sleep(3.5)  # > 3 metrics intervals
            assert e0.scrapes.count + e1.scrapes.count == before
    finally:
        e0.close()
        e1.close()


async def _eq(fn, value):
    return await fn() == value


async def _status_with(fn, key):
    st = await fn()
    return st if (st.get("autoscaling") or {}).get(key) else None


async def _status_reason(fn, reason):
    st = await fn()
    return st if (st.get("autoscaling") or {}).get("reason") == reason else None


async def _events(api, name):
    return [e for e in await api.list("v1", "events", "default")
            if e.get("involvedObject", {}).get("name") == name and e.get("reason") in ("ScaledUp", "ScaledDown")]


async def _gone(api, name):
    return await api.get(AV, PL, "default", name) is None


async def test_unreadable_pod_does_not_block_then_all_unreadable_holds_then_disable(api, emulator):
    name = "batch"
    good = MetricEndpoint()
    dead_port = MetricEndpoint()
    dead_port.close()  # nothing listens on this port any more: scrapes fail (connection refused)
    try:
        async with running_operator(*MODULES):
            obj = autoscaled(name)
            obj["spec"]["autoscaling"].update(minReplicas=2, maxReplicas=4, scaleDownStabilizationSeconds=600)
            obj["spec"]["replicas"] = 1
            await api.create(AV, PL, "default", obj)
            dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
            assert dep["spec"]["replicas"] == 2  # minReplicas, not spec.replicas
            labels = dep["spec"]["template"]["metadata"]["labels"]

            async def replicas() -> int:
                return (await api.get("apps/v1", "deployments", "default", name))["spec"]["replicas"]

            async def status() -> dict:
                return (await api.get(AV, PL, "default", name)).get("status") or {}

            # One of two Ready pods cannot be read: the other one's load still drives a decision.
            good.set(kv=1.0, waiting=20)
            await api.create("v1", "pods", "default", pod("batch-0", labels, good.port, ready=True))
            await api.create("v1", "pods", "default", pod("batch-1", labels, dead_port.port, ready=True))
            await wait_for(lambda: _eq(replicas, 4), timeout=20)
            st = await wait_for(lambda: _status_reason(status, "QueueLengthHigh"))
            assert st["autoscaling"]["scrapedPods"] == 1 and st["desiredReplicas"] == 4

            # Now neither pod can be read: hold the size, say why, warn once.
            good.close()
            st = await wait_for(lambda: _status_reason(status, "MetricsUnavailable"), timeout=20)
            assert "metrics of 2 of 2 Ready pods unreadable" in st["autoscaling"]["message"]
            assert await replicas() == 4
            warnings = [e for e in await api.list("v1", "events", "default")
                        if e.get("involvedObject", {}).get("name") == name and e.get("type") == "Warning"
                        and e.get("reason") == "MetricsUnavailable"]
            assert len(warnings) == 1

            # Autoscaling off: spec.replicas rules again (the reconcile applies it).
            await api.patch(AV, PL, "default", name, {"spec": {"autoscaling": {"enabled": False}}})
            await wait_for(lambda: _eq(replicas, 1), timeout=20)
    finally:
        good.close()


async def test_starting_pod_counts_as_capacity_end_to_end(api, emulator):
    """Two loaded Ready pods + one starting pod, maxReplicas 4: the Deployment goes to 4 and the
    Event names the counted starting pod; with a load the starting pod covers: no change."""
    ends = [MetricEndpoint() for _ in range(4)]
    try:
        async with running_operator(*MODULES):
            labels = {}
            for name in ("hot", "warm"):
                obj = autoscaled(name)
                obj["spec"]["autoscaling"].update(minReplicas=3, maxReplicas=4)
                await api.create(AV, PL, "default", obj)
                dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", name))
                assert dep["spec"]["replicas"] == 3  # minReplicas
                labels[name] = dep["spec"]["template"]["metadata"]["labels"]
            # hot: queue 20 per Ready pod (target 5): r = ceil(2 × 4) = 8 -> maxReplicas 4 > 2 + 1.
            # warm: queue 7 per Ready pod: r = ceil(2 × 1.4) = 3 = 2 Ready + 1 starting.
            for e, waiting in zip(ends, (20, 20, 7, 7)):
                e.set(kv=1.0 if waiting == 20 else 0.5, waiting=waiting)
            for name in ("hot", "warm"):  # the starting pods first: no tick sees only the Ready ones
                await api.create("v1", "pods", "default", pod(f"{name}-2", labels[name], 1, ready=False))
            for i, (name, e) in enumerate(zip(("hot", "hot", "warm", "warm"), ends)):
                await api.create("v1", "pods", "default", pod(f"{name}-{i % 2}", labels[name], e.port, ready=True))

            async def replicas(name) -> int:
                return (await api.get("apps/v1", "deployments", "default", name))["spec"]["replicas"]

            async def status(name) -> dict:
                return (await api.get(AV, PL, "default", name)).get("status") or {}

            await wait_for(lambda: _eq(lambda: replicas("hot"), 4), timeout=20)
            st = await wait_for(lambda: _status_with(lambda: status("hot"), "lastScaleTime"))
            expected = "scaled 3→4: waiting requests 20.0/replica > target 5; 1 starting counted (hot-2)"
            assert st["autoscaling"]["message"] == expected and st["desiredReplicas"] == 4
            (event,) = await wait_for(lambda: _events(api, "hot"))
            assert event["reason"] == "ScaledUp" and event["message"] == expected

            async def covered():
                auto = (await status("warm")).get("autoscaling") or {}
                return auto if "covered by" in (auto.get("message") or "") else None
            auto = await wait_for(covered, timeout=20)
            assert auto["reason"] == "ReplicasStarting"
            assert "recommendation 3 covered by 2 Ready + 1 starting counted (warm-2)" in auto["message"]
            scrapes = ends[2].scrapes.count
            await wait_for(lambda: ends[2].scrapes.count >= scrapes + 3, timeout=20)  # three more ticks
            assert await replicas("warm") == 3 and await replicas("hot") == 4
            assert not await _events(api, "warm")

            # Every write with the operator's credentials: the user's spec untouched, the
            # Deployments' writes after creation only their replicas.
            assert_operator_never_wrote_spec(emulator.writes)
            ours = [w for w in emulator.writes if w["auth"] == f"Bearer {OPERATOR_TOKEN}"]
            assert [w["data"] for w in ours if w["resource"] == "deployments" and w["method"] == "PATCH"] \
                == [{"spec": {"replicas": 4}}]
            assert not [w for w in ours if w["resource"] == "pods"]  # no scale-down: no pod written
    finally:
        for e in ends:
            e.close()


def test_the_spec_write_check_sees_every_form_of_write():
    """assert_operator_never_wrote_spec itself: what it must refuse, and kopf's writes it allows."""
    def w(data, subresource=None, method="PATCH", token=OPERATOR_TOKEN):
        return {"method": method, "resource": PL, "namespace": "default", "name": "x",
                "subresource": subresource, "data": data, "auth": f"Bearer {token}"}
    kopf_writes = [
        w({"status": {"autoscaling": {"reason": "LoadLow"}}}, "status"),
        w([{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
           {"op": "add", "path": "/metadata/finalizers", "value": ["serving.kvfleet.dev/kopf-finalizer"]}]),
        w({"metadata": {"annotations": {"kopf.serving.kvfleet.dev/last-handled-configuration": "{}"}}}),
        w([{"op": "replace", "path": "/status/desiredReplicas", "value": 3}], "status"),
        w({"spec": {"replicas": 9}}, token="someone-else"),  # not the operator's credentials
    ]
    assert_operator_never_wrote_spec(kopf_writes)
    for bad in (
        w({"spec": {"replicas": 3}}, "scale"),
        w({"status": {"replicas": 3}}, "scale"),  # any /scale write is a spec.replicas write
        w({"spec": {"replicas": 3}}),
        w([{"op": "replace", "path": "/spec/replicas", "value": 3}]),
        w([{"op": "replace", "path": "", "value": {}}]),
        w([{"op": "move", "from": "/spec/replicas", "path": "/metadata/annotations/kopf.serving.kvfleet.dev~1x"}]),
        w({"spec": {"replicas": 3}, "status": {}}, "status"),
        w([{"op": "add", "path": "/spec/autoscaling/enabled", "value": True}], "status"),
        w({"metadata": {"annotations": {"example.com/owner": "me"}}}),
        w({"apiVersion": AV, "kind": "InferenceService", "spec": {}}, method="PUT"),
        w({"metadata": {"name": "x"}, "spec": {}}, method="POST"),
    ):
        try:
            assert_operator_never_wrote_spec(kopf_writes + [bad])
        except AssertionError:
            continue
        raise AssertionError(f"not caught: {bad}")
