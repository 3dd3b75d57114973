"""The reconcile's model-weights step (I/O glue): pin the sources, keep the cache claim and download Jobs,
read where the downloads are.

1. ``pin_sources``: once per generation, each hf:// and s3:// source is resolved to a revision
   (``resolve``; a commit, an ETag digest) and recorded in ``status.model``; later passes of the same
   generation reuse it, so every replica fetches the same bytes. A source that cannot be pinned (not
   found, unauthorized, a .gguf path that is not in the repository) is ``Unrealisable``: Degraded,
   naming the field.
2. ``prepare`` (shared cache): creates or patches the claim, creates one download Job per source and
   pinned revision (pruning the source's other revisions except the one the Deployment serves),
   deletes the Jobs of revisions no longer pinned, and decides the pins the Deployment is rendered
   with: the new ones once every Job succeeded; until then the ones it already serves (other spec
   changes still roll out), or none at all — the Deployment is then neither created nor changed, so
   no pod starts (and holds a GPU) before its weights are there. A failed Job of an older generation
   is replaced (a spec change retries). The per-pod modes need none of this (init containers), and a
   claim or Jobs left from an earlier shared cache are deleted.
3. ``observe``: the downloads of this generation — Job states (shared) or the serving pods'
   model-download init containers (per-pod) — with the progress gauges read from the running
   downloaders (``scrape``) and the last line of failed ones; ``model_status`` turns them into the
   ModelReady condition and a Degraded reason.

Deletion: the claim and the Jobs carry the InferenceService's controller ownerReference, so the
garbage collector deletes them (and the Jobs' pods) with it; the cached weights go with the claim.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet_server.download import DOWNLOADED, EXPECTED, Failure
from prometheus_client.parser import text_string_to_metric_families

from . import api, apply, cache, child_write, kube, render, resolve, scrape
from .model_source import Pin, Source
from .model_status import MODEL_READY, Download, termination_line

PROGRESS_INTERVAL_S = 10.0  # how often the ModelReady message follows a running download
_RESOLVE_HINT = ("; the operator reads the Hub or bucket with its own identity (docs/operator.md: resolving "
                 "revisions), or pin a commit in the uri: hf://ORG/REPO@<commit>")


@dataclass
class Plan:
    """The outcome of ``prepare``: the pinned revisions (uri -> Pin), the pins the Deployment is
    rendered with (None: leave the Deployment as it is), status.model, and the live download Job of
    each source (shared cache)."""
    pins: dict[str, Pin]
    serving: dict[str, Pin] | None
    status: dict[str, Any]
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _old_pins(obj: dict[str, Any]) -> dict[str, Pin]:
    model = (obj.get("status") or {}).get("model")
    gen = (obj.get("metadata") or {}).get("generation")
    if not isinstance(model, dict) or model.get("generation") != gen:
        return {}
    return {s["uri"]: Pin(s["revision"]) for s in model.get("sources") or [] if s.get("uri") and s.get("revision")}


async def pin_sources(obj: dict[str, Any], spec: api.InferenceServiceSpec) -> dict[str, Pin]:
    """uri -> Pin for every downloaded source: reused from status.model within a generation, else
    resolved. Raises render.Unrealisable naming the field (retryable when the store was unreachable)."""
    known = _old_pins(obj)
    todo = [s for s in cache.downloaded(spec) if s.uri not in known]
    s3 = cache.s3_options(spec)
    results = await asyncio.gather(*(resolve.resolve(s, s3) for s in todo), return_exceptions=True)
    for source, result in zip(todo, results):
        if isinstance(result, Failure):
            hint = _RESOLVE_HINT if result.reason in ("Unauthorized", "RepositoryNotFound", "BucketNotFound") else ""
            raise render.Unrealisable(result.reason, f"{source.field}: {result.message}{hint}",
                                      retryable=not result.permanent)
        if isinstance(result, BaseException):
            raise result
        known[source.uri] = result
    return {s.uri: known[s.uri] for s in cache.downloaded(spec)}


def model_status(obj: dict[str, Any], spec: api.InferenceServiceSpec, pins: dict[str, Pin]) -> dict[str, Any]:
    """status.model: served name, the revision of spec.model.uri, the generation, every pinned source."""
    main = pins.get(spec.model.uri)
    return {"name": spec.served_model_name, "revision": main.revision if main else None,
            "generation": (obj.get("metadata") or {}).get("generation"),
            "sources": [{"field": s.field, "uri": s.uri, "revision": pins[s.uri].revision}
                        for s in cache.downloaded(spec)]}


def job_state(job: dict[str, Any]) -> str:
    """pending, running, succeeded or failed, from a Job's status."""
    st = job.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
    if (st.get("succeeded") or 0) > 0 or conds.get("Complete") == "True":
        return "succeeded"
    if conds.get("Failed") == "True":
        return "failed"
    return "running" if (st.get("active") or 0) > 0 else "pending"


def _ours(obj: dict[str, Any] | None, uid: str | None) -> bool:
    return obj is not None and apply.controlled_by(obj, uid)


async def prepare(client: kube.KubeClient, obj: dict[str, Any], spec: api.InferenceServiceSpec,
                  pins: dict[str, Pin], live_deployment: dict[str, Any] | None,
                  defaults: render.ServingDefaults, being_deleted: Callable[[], Awaitable[bool]],
                  logger: logging.Logger | logging.LoggerAdapter = logging.getLogger("kvfleet.operator")) -> Plan:
    """Keep the claim and the download Jobs of a shared cache (see the module docstring).

    ``being_deleted``: asked before creating anything; when the InferenceService is going away (a pass
    queued behind a deletion), nothing is created and the Deployment is left alone. No request at all for
    a spec that downloads nothing and whose last status pinned nothing (no claim or Job of ours can
    exist): the common pass of a pvc://, file:// or bundled:// model costs no API call here."""
    meta = obj["metadata"]
    name, namespace, uid = meta["name"], meta.get("namespace") or "default", meta.get("uid")
    plan = Plan(pins, pins, model_status(obj, spec, pins))
    owner = render.owner_reference(obj)
    want_claim = cache.claim(obj, spec, owner)
    last = (obj.get("status") or {}).get("model")
    if want_claim is None and not cache.downloaded(spec) and not (isinstance(last, dict) and last.get("sources")):
        return plan
    live_claim = await client.get("v1", "persistentvolumeclaims", namespace, cache.claim_name(name))
    jobs = await client.list("batch/v1", "jobs", namespace, label_selector=cache.download_selector(name))
    jobs = [j for j in jobs if _ours(j, uid)]
    if want_claim is None:  # per-pod modes: what an earlier shared cache left goes
        for job in jobs:
            await client.delete("batch/v1", "jobs", namespace, job["metadata"]["name"])
        if _ours(live_claim, uid):
            await client.delete("v1", "persistentvolumeclaims", namespace, cache.claim_name(name))
        return plan
    if live_claim is not None and not _ours(live_claim, uid):
        raise render.Unrealisable("ChildConflict", f"PersistentVolumeClaim {namespace}/{cache.claim_name(name)} exists "
                                                   f"and is not controlled by this InferenceService; delete or rename "
                                                   f"it", retryable=True)
    names = {j["metadata"]["name"] for j in jobs}
    missing = live_claim is None or any(cache.job_name(name, s, pins[s.uri]) not in names
                                        for s in cache.downloaded(spec))
    if missing and await being_deleted():
        plan.serving = None
        return plan
    action, body = apply.plan(want_claim, live_claim)
    # a 422 on patch: e.g. a smaller size, or another storage class (a claim cannot change so)
    await child_write.write(client, logger, action, body, live_claim, "v1", "persistentvolumeclaims", namespace,
                            cache.claim_name(name), "PersistentVolumeClaim", invalid_field="spec.modelCache.shared")
    served = cache.served_revisions(live_deployment)
    dl = render.downloader(spec, defaults, resolve.hf_endpoint())
    by_name = {j["metadata"]["name"]: j for j in jobs}
    generation = meta.get("generation") or 0
    for source in cache.downloaded(spec):
        job_name = cache.job_name(name, source, pins[source.uri])
        job = by_name.get(job_name)
        if job is not None and job_state(job) == "failed" and \
                int((job["metadata"].get("annotations") or {}).get(cache.GENERATION_ANNOTATION) or 0) < generation:
            await client.delete("batch/v1", "jobs", namespace, job_name)  # the spec changed since: try again
            job = None
        if job is None:
            keep = [served[source.uri]] if source.uri in served else []
            job = await child_write.write(client, logger, "create", cache.download_job(
                obj, spec, source, pins[source.uri], dl, keep, owner, render.pod_security_context()), None,
                "batch/v1", "jobs", namespace, job_name, "Job")
        plan.jobs[source.uri] = job
    wanted = {j["metadata"]["name"] for j in plan.jobs.values()}
    for job_name in by_name.keys() - wanted:  # revisions no longer pinned, sources no longer used
        await client.delete("batch/v1", "jobs", namespace, job_name)
    if all(job_state(j) == "succeeded" for j in plan.jobs.values()):
        return plan
    uris = [s.uri for s in cache.downloaded(spec)]
    plan.serving = {u: Pin(served[u]) for u in uris} if live_deployment is not None and all(
        u in served for u in uris) else None
    return plan


def parse_progress(text: str) -> tuple[float | None, float | None]:
    """(downloaded, expected) bytes from a downloader's Prometheus text (None when absent)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (DOWNLOADED, EXPECTED):
                values[sample.name] = float(sample.value)
    return values.get(DOWNLOADED), values.get(EXPECTED) or None


async def _read_progress(running: list[tuple[Source, str, str, dict[str, Any]]]) -> list[Download]:
    """Scrape each running downloader (source, revision, where, pod)."""
    targets = [scrape.ScrapeTarget(where, scrape.pod_metrics_url(pod, cache.PROGRESS_PORT_NAME) or "")
               for _, _, where, pod in running]
    found = [t for t in targets if t.url]
    results = {r.name: r for r in await scrape.scrape_all(found, parse=parse_progress)}
    out = []
    for source, revision, where, _ in running:
        r = results.get(where)
        done, total = r.metrics if r is not None and r.metrics is not None else (None, None)
        out.append(Download(source, revision, "running", where, done, total))
    return out


def _init_state(pod: dict[str, Any], container: str) -> str:
    """State of one model-download init container of a serving pod: pending, running, succeeded, failed
    (it exited 3: retrying cannot help; other exits are retried by the kubelet, so still running)."""
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") != container:
            continue
        state, last = cs.get("state") or {}, cs.get("lastState") or {}
        if (state.get("terminated") or {}).get("exitCode") == 0:
            return "succeeded"
        if ((state.get("terminated") or last.get("terminated")) or {}).get("exitCode") == 3:
            return "failed"
        return "running" if state.get("running") else "pending"
    return "pending"


async def observe(client: kube.KubeClient, obj: dict[str, Any], spec: api.InferenceServiceSpec, plan: Plan,
                  serving_pods: list[dict[str, Any]]) -> list[Download]:
    """The downloads of this generation, with progress and failures (see ``model_status``)."""
    meta = obj["metadata"]
    downloads: list[Download] = []
    running: list[tuple[Source, str, str, dict[str, Any]]] = []
    sources = cache.downloaded(spec)
    if plan.jobs:
        pods = await client.list("v1", "pods", meta.get("namespace") or "default",
                                 label_selector=cache.download_selector(meta["name"]),
                                 not_older_than=kube.seen("pods"))
        for source in sources:
            job = plan.jobs[source.uri]
            job_name, state = job["metadata"]["name"], job_state(job)
            mine = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(
                "serving.kvfleet.dev/download-job") == job_name]
            live = [p for p in mine if (p.get("status") or {}).get("phase") == "Running"]
            if state in ("pending", "running") and live:
                running.append((source, plan.pins[source.uri].revision, f"job {job_name}", live[0]))
                continue
            line = next((ln for p in mine if (ln := termination_line(p, cache.DOWNLOAD_CONTAINER))), None)
            downloads.append(Download(source, plan.pins[source.uri].revision, state, f"job {job_name}",
                                      last_line=line))
    elif spec.model_cache.shared is None:
        for pod in serving_pods:
            pod_name = (pod.get("metadata") or {}).get("name", "?")
            for i, source in enumerate(sources):
                container = f"{cache.DOWNLOAD_CONTAINER}-{i}" if i else cache.DOWNLOAD_CONTAINER
                state = _init_state(pod, container)
                revision = (plan.serving or plan.pins)[source.uri].revision
                if state == "running":
                    running.append((source, revision, f"pod {pod_name}", pod))
                elif state != "succeeded":
                    downloads.append(Download(source, revision, state, f"pod {pod_name}",
                                              last_line=termination_line(pod, container)))
    return downloads + await _read_progress(running)


def downloading(status: dict[str, Any] | None, **_: Any) -> bool:
    """Whether ModelReady says Downloading (the progress timer runs only then)."""
    return any(c.get("type") == MODEL_READY and c.get("reason") == "Downloading"
               for c in (status or {}).get("conditions") or [])

