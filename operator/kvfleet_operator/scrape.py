"""Read pods' Prometheus /metrics: the vLLM gauges the autoscaler decides on.

Parsing uses ``prometheus_client.parser.text_string_to_metric_families`` (the Prometheus text
exposition format, as kvfleet-server and vLLM serve it); fetching uses one ``httpx.AsyncClient``
with a short timeout per pod, all pods concurrently. A pod that does not answer, answers with an
error status, sends an oversized or unparsable body yields a result with ``metrics=None`` and an
error string — never zeros.

Metrics read (labels ``model_name``, ``engine`` may repeat them per served model/engine):
``vllm:kv_cache_usage_perc`` (fallback: the older ``vllm:gpu_cache_usage_perc``) — mean over the
pod's series, a fraction 0..1; ``vllm:num_requests_waiting`` and ``vllm:num_requests_running`` —
summed over the pod's series, request counts; ``kvfleet:kv_cache_blocks_cached`` (kvfleet-server
only) — summed, blocks, used only to order the pods a scale-down removes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .autoscale import PodMetrics

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
BLOCKS_CACHED = "kvfleet:kv_cache_blocks_cached"
DEFAULT_TIMEOUT_SECONDS = 2.0
MAX_BODY_BYTES = 8 * 1024 * 1024
HTTP_PORT_NAME = "http"


@dataclass(frozen=True)
class ScrapeTarget:
    """A pod to read: its name and the full metrics URL (``http://IP:PORT/metrics``)."""

    name: str
    url: str


@dataclass(frozen=True)
class ScrapeResult:
    """The outcome for one target: ``metrics`` on success, else ``None`` and ``error``."""

    name: str
    metrics: Any  # what ``parse`` returned (PodMetrics by default); None on failure
    error: str | None = None


def _valid(values: Iterable[float], lo: float, hi: float) -> list[float]:
    return [v for v in values if math.isfinite(v) and lo <= v <= hi]


def parse_metrics(text: str) -> PodMetrics:
    """Extract the autoscaling gauges from Prometheus text exposition.

    Returns a PodMetrics whose fields are ``None`` for metrics the text does not contain (or whose
    every sample is NaN/out of range: KV usage outside [0, 1], negative counts).
    Raises ValueError when the text is not valid exposition format.
    """
    samples: dict[str, list[float]] = {KV_USAGE: [], KV_USAGE_OLD: [], WAITING: [], RUNNING: [],
                                       BLOCKS_CACHED: []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in samples:
                samples[sample.name].append(float(sample.value))
    kv = _valid(samples[KV_USAGE], 0.0, 1.0) or _valid(samples[KV_USAGE_OLD], 0.0, 1.0)
    waiting = _valid(samples[WAITING], 0.0, math.inf)
    running = _valid(samples[RUNNING], 0.0, math.inf)
    cached = _valid(samples[BLOCKS_CACHED], 0.0, math.inf)
    return PodMetrics(kv_cache_usage=sum(kv) / len(kv) if kv else None,
                      num_requests_waiting=sum(waiting) if waiting else None,
                      num_requests_running=sum(running) if running else None,
                      kv_cache_blocks_cached=sum(cached) if cached else None)


def pod_metrics_url(pod: Mapping[str, Any], port_name: str = HTTP_PORT_NAME,
                    path: str = "/metrics") -> str | None:
    """The metrics URL of a Pod object: ``status.podIP`` and the port its containers declare.

    Takes the containerPort named ``port_name`` (of a container, else of an init container: the model
    download's progress), else the first declared TCP containerPort.
    Returns None when the pod has no IP yet or declares no port.
    """
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    spec = pod.get("spec") or {}
    ports = [p for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
             for p in c.get("ports") or [] if p.get("protocol", "TCP") == "TCP" and p.get("containerPort")]
    if not ports:
        return None
    port = next((p for p in ports if p.get("name") == port_name), ports[0])["containerPort"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{int(port)}{path}"


async def scrape_one(client: httpx.AsyncClient, target: ScrapeTarget, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                     parse: Callable[[str], Any] = parse_metrics) -> ScrapeResult:
    """GET one target's metrics and ``parse`` them (default: the autoscaling gauges); never raises for
    network, HTTP or parse failures."""
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("GET", target.url, timeout=timeout) as resp:
                if resp.status_code != 200:
                    return ScrapeResult(target.name, None, f"HTTP {resp.status_code}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        return ScrapeResult(target.name, None,
                                            f"body larger than {MAX_BODY_BYTES} bytes")
        text = body.decode("utf-8", errors="replace")
        return ScrapeResult(target.name, parse(text))
    except (TimeoutError, asyncio.TimeoutError):
        return ScrapeResult(target.name, None, f"timed out after {timeout:g}s")
    except httpx.HTTPError as e:
        return ScrapeResult(target.name, None, f"{type(e).__name__}: {e}".rstrip(": "))
    except ValueError as e:  # exposition-format parse errors
        return ScrapeResult(target.name, None, f"unparsable metrics: {e}")


async def scrape_all(targets: Sequence[ScrapeTarget], timeout: float = DEFAULT_TIMEOUT_SECONDS,
                     client: httpx.AsyncClient | None = None,
                     parse: Callable[[str], Any] = parse_metrics) -> list[ScrapeResult]:
    """Scrape every target concurrently; results in the order of ``targets``.

    ``timeout`` (seconds) bounds each pod separately, so the whole call takes about one timeout at
    worst. A client may be passed in for reuse; otherwise one is made (and closed) per call.
    """
    if not targets:
        return []
    if client is not None:
        return list(await asyncio.gather(*(scrape_one(client, t, timeout, parse) for t in targets)))
    limits = httpx.Limits(max_connections=max(len(targets), 1), max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as own:
        return list(await asyncio.gather(*(scrape_one(own, t, timeout, parse) for t in targets)))
