"""The scraper against small real HTTP servers: prometheus_client's own exposition server, plus
servers that hang, fail or send garbage."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvfleet_operator.scrape import (ScrapeTarget, parse_metrics, pod_metrics_url, scrape_all)


def vllm_registry(kv: float | None, waiting: float, running: float, old_name_only: bool = False,
                  engines: int = 1) -> CollectorRegistry:
    """A registry with vLLM's gauge names and labels, as kvfleet-server exports them."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    kv_g = Gauge("vllm:gpu_cache_usage_perc" if old_name_only else "vllm:kv_cache_usage_perc",
                 "KV-cache usage", labels, registry=r)
    w = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
    run = Gauge("vllm:num_requests_running", "running", labels, registry=r)
    Counter("vllm:prompt_tokens", "prompt tokens", labels, registry=r).labels("m", "0").inc(123)
    for e in range(engines):
        if kv is not None:
            kv_g.labels("m", str(e)).set(kv)
        w.labels("m", str(e)).set(waiting)
        run.labels("m", str(e)).set(running)
    return r


@contextlib.contextmanager
def exposition_server(registry: CollectorRegistry):
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.asynccontextmanager
async def raw_server(reply: bytes | None):
    """A TCP server that answers every connection with `reply` (None: never answers)."""
    hold = asyncio.Event()

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if reply is None:
            await hold.wait()
        else:
            writer.write(reply)
            await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        hold.set()
        srv.close()


def test_parse_real_exposition():
    from prometheus_client import generate_latest
    text = generate_latest(vllm_registry(0.42, 3, 7)).decode()
    m = parse_metrics(text)
    assert (m.kv_cache_usage, m.num_requests_waiting, m.num_requests_running) == (0.42, 3, 7)


def test_parse_sums_queues_and_averages_usage_over_engines():
    from prometheus_client import generate_latest
    r = vllm_registry(0.5, 2, 1, engines=2)
    r._names_to_collectors["vllm:kv_cache_usage_perc"].labels("m", "1").set(0.9)
    m = parse_metrics(generate_latest(r).decode())
    assert m.kv_cache_usage == pytest.approx(0.7)
    assert m.num_requests_waiting == 4 and m.num_requests_running == 2


def test_parse_falls_back_to_old_kv_name_and_reports_absent_as_none():
    from prometheus_client import generate_latest
    m = parse_metrics(generate_latest(vllm_registry(0.25, 0, 0, old_name_only=True)).decode())
    assert m.kv_cache_usage == 0.25
    m = parse_metrics("# TYPE other gauge\nother 1\n")
    assert m.kv_cache_usage is None and m.num_requests_waiting is None
    # NaN and out-of-range samples are not data.
    m = parse_metrics('vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:num_requests_waiting -3\n')
    assert m.kv_cache_usage is None and m.num_requests_waiting is None


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus\n")


async def test_scrape_all_reads_real_servers_and_isolates_failures():
    ok = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\nConnection: close\r\n\r\noops"
    junk = b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\nConnection: close\r\n\r\nnot { metrics\n"
    with exposition_server(vllm_registry(0.93, 12, 4)) as u1, \
            exposition_server(vllm_registry(0.10, 0, 1)) as u2:
        async with raw_server(None) as hang, raw_server(ok) as err, raw_server(junk) as bad:
            targets = [ScrapeTarget("a", u1), ScrapeTarget("hang", hang), ScrapeTarget("b", u2),
                       ScrapeTarget("err", err), ScrapeTarget("bad", bad),
                       ScrapeTarget("refused", "http://127.0.0.1:9/metrics")]
            results = await scrape_all(targets, timeout=0.5)
    by = {r.name: r for r in results}
    assert [r.name for r in results] == [t.name for t in targets]
    assert by["a"].metrics.kv_cache_usage == 0.93 and by["a"].metrics.num_requests_waiting == 12
    assert by["b"].metrics.kv_cache_usage == 0.10 and by["b"].metrics.num_requests_running == 1
    assert by["hang"].metrics is None and "timed out" in by["hang"].error
    assert by["err"].metrics is None and "HTTP 500" in by["err"].error
    assert by["bad"].metrics is None and "unparsable" in by["bad"].error
    assert by["refused"].metrics is None and by["refused"].error


async def test_scrape_is_concurrent():
    """Three servers that answer only once all three requests are in flight: a sequential scraper
    would time out on the first one."""
    from prometheus_client import generate_latest
    body = generate_latest(vllm_registry(0.5, 1, 1))
    arrived, all_in = 0, asyncio.Event()

    async def handle(reader, writer):
        nonlocal arrived
        await reader.readuntil(b"\r\n\r\n")
        arrived += 1
        if arrived == 3:
            all_in.set()
        await all_in.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                     + body)
        await writer.drain()
        writer.close()

    servers = [await asyncio.start_server(handle, "127.0.0.1", 0) for _ in range(3)]
    try:
        targets = [ScrapeTarget(str(i), f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}/metrics")
                   for i, s in enumerate(servers)]
        results = await scrape_all(targets, timeout=5)
    finally:
        for s in servers:
            s.close()
    assert [r.error for r in results] == [None] * 3
    assert all(r.metrics.kv_cache_usage == 0.5 for r in results)


@pytest.mark.parametrize("pod,url", [
    ({"status": {"podIP": "10.0.0.5"},
      "spec": {"containers": [{"ports": [{"name": "other", "containerPort": 9000},
                                         {"name": "http", "containerPort": 8000}]}]}},
     "http://10.0.0.5:8000/metrics"),
    ({"status": {"podIP": "127.0.0.1"}, "spec": {"containers": [{"ports": [{"containerPort": 31234}]}]}},
     "http://127.0.0.1:31234/metrics"),
    ({"status": {"podIP": "fd00::7"}, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}},
     "http://[fd00::7]:8000/metrics"),
    ({"status": {}, "spec": {"containers": [{"ports": [{"containerPort": 8000}]}]}}, None),
    ({"status": {"podIP": "10.0.0.5"}, "spec": {"containers": [{"name": "x"}]}}, None),
    ({"status": {"podIP": "10.0.0.5"},
      "spec": {"containers": [{"ports": [{"containerPort": 53, "protocol": "UDP"}]}]}}, None),
])
def test_pod_metrics_url_uses_pod_ip_and_declared_port(pod, url):
    assert pod_metrics_url(pod) == url
