"""Strict children at reconcile (issue 34, must-show 2): the real kopf runtime against KMock.

A typo in ``spec.scheduling.affinity`` — which the real API server would drop with only a warning,
giving pods that schedule anywhere — makes the InferenceService Degraded/InvalidSpec naming the path,
with nothing created; fixing the spec creates the children. Every write of the operator's own client
asks the API server for strict field validation (``fieldValidation=Strict``).
"""
from __future__ import annotations

from typing import Any, AsyncIterator

import kmock
import kopf
import pytest

from kmock_support import ApiServerEmulator, register_resources, running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import kube

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
CHILD_PLURALS = {"deployments", "services", "poddisruptionbudgets"}
GOOD_AFFINITY = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}]}]}}


class ParamsEmulator(ApiServerEmulator):
    """The tests' emulator, also keeping each write's query parameters (``writes[i]["params"]``)."""

    async def _handle(self, request: Any) -> Any:
        before = len(self.writes)
        result = await super()._handle(request)
        for write in self.writes[before:]:
            write["params"] = dict(request.params)
        return result


@pytest.fixture()
async def emulator() -> AsyncIterator[ParamsEmulator]:
    emu = ParamsEmulator()
    register_resources(emu)
    async with emu, kmock.Server(emu):
        yield emu


def _isvc(name: str, affinity: dict) -> dict:
    return {"apiVersion": AV, "kind": isvc_api.KIND,
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1"},
            "spec": {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0},
                     "scheduling": {"affinity": affinity}}}


def _degraded(obj: dict | None) -> dict:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Degraded"), {})


async def test_affinity_typo_is_degraded_at_reconcile_and_the_fix_creates_the_children(api, emulator):
    async with running_operator():
        await api.create(AV, PL, "default", _isvc("typo", {"nodeAffinty": GOOD_AFFINITY}))

        async def degraded():
            obj = await api.get(AV, PL, "default", "typo")
            return obj if _degraded(obj).get("status") == "True" else None
        obj = await wait_for(degraded)
        cond = _degraded(obj)
        # KMock reports Kubernetes 1.26: the schema is the oldest supported, 1.30
        assert cond["reason"] == "InvalidSpec"
        assert cond["message"] == "spec.scheduling.affinity.nodeAffinty: unknown field (the Kubernetes 1.30 schema)"
        assert await api.get("apps/v1", "deployments", "default", "typo") is None
        assert await api.get("v1", "services", "default", "typo") is None

        await api.patch(AV, PL, "default", "typo",
                        {"spec": {"scheduling": {"affinity": {"nodeAffinty": None, "nodeAffinity": GOOD_AFFINITY}}}})
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", "typo"))
        assert dep["spec"]["template"]["spec"]["affinity"] == {"nodeAffinity": GOOD_AFFINITY}

        async def cleared():
            o = await api.get(AV, PL, "default", "typo")
            return o if _degraded(o).get("status") == "False" else None
        await wait_for(cleared)

    ours = [w for w in emulator.writes if w["auth"] == "Bearer test-token"
            and (w["resource"] in CHILD_PLURALS or w["subresource"] == "status")]
    assert {w["method"] for w in ours} >= {"POST", "PATCH"}
    assert all(w["params"].get("fieldValidation") == "Strict" for w in ours), ours


async def test_client_writes_ask_for_strict_field_validation_and_read_the_version(unused_tcp_port):
    from aiohttp import web

    seen: list[tuple[str, str, dict]] = []

    async def handler(request):
        seen.append((request.method, request.path, dict(request.query)))
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "33+", "gitVersion": "v1.33.1-gke.100"})
        return web.json_response({"kind": "Pod", "metadata": {"name": "a"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    client = kube.KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{unused_tcp_port}", token="t"))
    try:
        await client.create("v1", "pods", "ns", {"metadata": {"name": "a"}})
        await client.patch("v1", "pods", "ns", "a", {"metadata": {"labels": {"x": "1"}}})
        await client.patch(AV, PL, "ns", "a", {"status": {}}, subresource="status")
        await client.get("v1", "pods", "ns", "a")
        assert await client.server_version() == "1.33+" and await client.server_version() == "1.33+"
    finally:
        await client.close()
        await runner.cleanup()
    writes = [(m, q) for m, p, q in seen if m in ("POST", "PATCH")]
    assert len(writes) == 3 and all(q == {"fieldValidation": "Strict"} for _, q in writes)
    assert [q for m, p, q in seen if m == "GET" and p != "/version"] == [{}]  # reads carry no parameter
    assert [p for _, p, _ in seen].count("/version") == 1  # read once per client
