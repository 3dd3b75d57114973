"""The small async REST client (kube.py) against the API emulator; the emulator's label selectors."""
from __future__ import annotations

import kopf
import pytest

from kvfleet_operator import kube


def test_resource_paths():
    assert kube.resource_path("v1", "pods", "ns") == "/api/v1/namespaces/ns/pods"
    assert kube.resource_path("apps/v1", "deployments", "ns", "d", "scale") == \
        "/apis/apps/v1/namespaces/ns/deployments/d/scale"
    assert kube.resource_path("kopf.dev/v1", "clusterkopfpeerings", None, "p") == "/apis/kopf.dev/v1/clusterkopfpeerings/p"


def _pod(name: str, labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}}


async def test_crud_errors_and_label_selectors(api):
    created = await api.create("v1", "pods", "ns", _pod("a", {"app": "x", "tier": "1"}))
    assert created["metadata"]["uid"] and created["metadata"]["resourceVersion"]
    await api.create("v1", "pods", "ns", _pod("b", {"app": "y"}))
    assert [p["metadata"]["name"] for p in await api.list("v1", "pods", "ns", label_selector="app=x")] == ["a"]
    assert [p["metadata"]["name"] for p in await api.list("v1", "pods", "ns", label_selector="app!=x")] == ["b"]
    assert [p["metadata"]["name"] for p in await api.list("v1", "pods", "ns", label_selector="tier")] == ["a"]
    assert len(await api.list("v1", "pods", "ns")) == 2
    with pytest.raises(kube.ApiError) as err:
        await api.create("v1", "pods", "ns", _pod("a", {}))
    assert err.value.status == 409
    patched = await api.patch("v1", "pods", "ns", "a", {"metadata": {"labels": {"tier": None}}})
    assert patched["metadata"]["labels"] == {"app": "x"}
    await api.delete("v1", "pods", "ns", "a")
    await api.delete("v1", "pods", "ns", "a")  # absent is fine
    assert await api.get("v1", "pods", "ns", "a") is None


async def test_unreachable_server_is_an_api_error():
    client = kube.KubeClient(kopf.ConnectionInfo(server="http://127.0.0.1:9", token="t"), connect_timeout_s=2)
    try:
        with pytest.raises(kube.ApiError) as err:
            await client.get("v1", "pods", "ns", "a")
        assert err.value.status == 503
    finally:
        await client.close()


async def test_login_reads_kubeconfig(kubeconfig, emulator):
    info = kube.login()
    assert info is not None and info.server == str(emulator.url).rstrip("/") and info.token == "test-token"
    client = kube.get_client()
    assert await client.get("v1", "pods", "ns", "nothing") is None
    await kube.close_client()


async def test_non_json_error_pages_are_api_errors(unused_tcp_port):
    """A proxy in front of the API server may answer with HTML: still an ApiError (retried), not a crash."""
    from aiohttp import web

    async def html(request):
        status = 502 if request.path.endswith("/a") else 200
        return web.Response(status=status, text="<html>Bad Gateway</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", html)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    client = kube.KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{unused_tcp_port}", token="t"))
    try:
        with pytest.raises(kube.ApiError) as err:
            await client.get("v1", "pods", "ns", "a")
        assert err.value.status == 502 and "Bad Gateway" in err.value.message
        with pytest.raises(kube.ApiError) as err:
            await client.get("v1", "pods", "ns", "b")  # 200 but not JSON
        assert err.value.status == 502 and err.value.reason == "BadResponse"
    finally:
        await client.close()
        await runner.cleanup()


async def test_401_rereads_credentials_once(unused_tcp_port, tmp_path, monkeypatch):
    """Bound service-account tokens rotate: a 401 makes the client read its credentials again and retry."""
    from aiohttp import web

    from kmock_support import write_kubeconfig

    seen = []

    async def handler(request):
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer test-token":
            return web.json_response({"reason": "Unauthorized", "message": "token expired"}, status=401)
        return web.json_response({"kind": "Pod", "metadata": {"name": "a"}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    url = f"http://127.0.0.1:{unused_tcp_port}"
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", url)))  # the rotated token
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    client = kube.KubeClient(kopf.ConnectionInfo(server=url, token="expired"))
    try:
        assert (await client.get("v1", "pods", "ns", "a"))["metadata"]["name"] == "a"
        assert seen == ["Bearer expired", "Bearer test-token"]
    finally:
        await client.close()
        await runner.cleanup()
        kube.set_credentials(None)


async def test_a_burst_queues_for_the_pool_without_timing_out(unused_tcp_port):
    """Issue 34: during a burst of reconciles, requests waiting for a pooled connection must not time
    out inside the client. 12 requests of 0.2 s each through 2 connections take 1.2 s; each waits up
    to 1 s for a connection, longer than the read timeout (0.5 s), and all succeed. At most 2 are in
    flight at once (the pool bounds the load on the API server)."""
    import asyncio

    from aiohttp import web

    in_flight, peak = 0, 0

    async def slow(request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1
        return web.json_response({"kind": "Pod", "metadata": {"name": request.path.rsplit("/", 1)[-1]}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    client = kube.KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{unused_tcp_port}", token="t"),
                             pool_size=2, read_timeout_s=0.5)
    try:
        got = await asyncio.gather(*(client.get("v1", "pods", "ns", f"p{i}") for i in range(12)))
        assert [g["metadata"]["name"] for g in got] == [f"p{i}" for i in range(12)]
        assert peak == 2
        # the read timeout still bounds an answer that never comes
        slow_client = kube.KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{unused_tcp_port}", token="t"),
                                      read_timeout_s=0.05)
        with pytest.raises(kube.ApiError) as err:
            await slow_client.get("v1", "pods", "ns", "late")
        assert err.value.status == 503
        await slow_client.close()
    finally:
        await client.close()
        await runner.cleanup()


async def test_field_selectors_reach_the_server(api):
    await api.create("v1", "events", "ns", {"apiVersion": "v1", "kind": "Event", "type": "Warning",
                                           "metadata": {"name": "e1", "namespace": "ns"}, "reason": "FailedMount",
                                           "involvedObject": {"kind": "Pod", "name": "a", "namespace": "ns"}})
    await api.create("v1", "events", "ns", {"apiVersion": "v1", "kind": "Event", "type": "Normal",
                                           "metadata": {"name": "e2", "namespace": "ns"}, "reason": "Pulled",
                                           "involvedObject": {"kind": "Pod", "name": "a", "namespace": "ns"}})
    got = await api.list("v1", "events", "ns", field_selector="involvedObject.name=a,type=Warning")
    assert [e["metadata"]["name"] for e in got] == ["e1"]
    assert [e["metadata"]["name"] for e in await api.list("v1", "events", "ns", field_selector="type!=Warning")] \
        == ["e2"]


async def test_list_freshness_reaches_the_server(unused_tcp_port, monkeypatch):
    """A consistent read by default; from the watch cache at any version (0) or at least as new as the
    newest pod event the operator acted on (NotOlderThan), which only a pod event raises."""
    from aiohttp import web
    queries: list[dict[str, str]] = []

    async def items(request):
        queries.append(dict(request.query))
        return web.json_response({"items": []})

    app = web.Application()
    app.router.add_get("/{tail:.*}", items)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    client = kube.KubeClient(kopf.ConnectionInfo(server=f"http://127.0.0.1:{unused_tcp_port}", token="t"))
    monkeypatch.setattr(kube, "_seen", {})
    try:
        await client.list("v1", "pods", "ns", label_selector="a=b")
        await client.list("v1", "pods", "ns", not_older_than=kube.seen("pods"))
        kube.saw("pods", "120")
        kube.saw("pods", "95")  # an older event (another pod's) never lowers it
        kube.saw("deployments", "400")  # another resource's revision: the pods cache may never reach it
        await client.list("v1", "pods", "ns", not_older_than=kube.seen("pods"))
    finally:
        await client.close()
        await runner.cleanup()
    assert queries == [{"labelSelector": "a=b"}, {"resourceVersion": "0"},
                       {"resourceVersion": "120", "resourceVersionMatch": "NotOlderThan"}]
