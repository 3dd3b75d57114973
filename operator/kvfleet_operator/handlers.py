"""kopf handlers: thin glue around read -> render -> apply -> status.

Triggers: an InferenceService is created, its spec/metadata changes, or the operator (re)starts
(kopf's last-handled state is in memory, ``diffbase``: after a start every object is seen as
created); an owned Deployment/Service/PodDisruptionBudget/InferencePool/HTTPRoute/model-download Job
changes or is deleted (every ``weights.PROGRESS_INTERVAL_S`` while a model downloads, for its progress) (the event names
its controller InferenceService, which is then reconciled); a serving pod starts or stops failing
(its ``serving.kvfleet.dev/inferenceservice`` label names the owner; ``pods.pod_problem``); a
Warning Event says a pod's volume does not attach or mount (``FailedAttachVolume`` such as
Multi-Attach, ``FailedMount``; only Events about pods with ``type=Warning`` are watched, filtered by
the API server). One pass (``reconcile``), under the object's lock:

0. read the InferenceService fresh (whatever an event carried may be older than the last status
   write): status is computed from this one read and the children read after it, never from a
   copy taken before the lock;
1. parse and render the spec (pure), the children checked against the strict Kubernetes schema of
   the API server's version (``strict``: an unknown field in ``scheduling.affinity`` is named by its
   path); a spec that cannot be realised -> status Degraded=True with reason and message, no child
   touched, ``kopf.PermanentError`` (no retry until the spec changes);
   the hf:// and s3:// model sources are pinned once per generation (``weights.pin_sources``);
2. read the live children (not those that no pass and no watch event has seen: ``observed``; creating
   one of them answered 409 starts the pass over, reading it); one that exists but is controlled by something else, or is not labelled
   as this InferenceService's, is a conflict (Degraded ``ChildConflict``, retried with backoff so
   that removing the object in the way is enough) — the operator never takes over objects it did
   not create; orphans it did create (``--cascade=orphan``) are adopted;
3. keep the model cache (``weights.prepare``: a shared cache's claim and download Jobs; the Deployment
   is neither created nor moved to new weights before they are downloaded); create or three-way merge-patch each child (``apply``; ``fieldValidation=Strict``), delete the PDB
   when no longer wanted; a child the API server refuses as invalid (422, e.g. a value only it checks) is
   Degraded ``ChildInvalid`` with the server's message, permanent like an unrealisable spec; any
   other refusal (a full Service IP range, a quota's 403, a 500) is retried with backoff and, from
   the second failure in a row on, reported as Degraded ``ChildCreateFailed`` / ``ChildUpdateFailed``
   with the server's message (the other children are still applied, the status still written); then
   the routing objects of spec.routing (``routing_sync``: InferencePool, endpoint picker, HTTPRoute);
4. list the serving pods (and the Warning Events of those still Pending): one that crash-loops, was
   OOM-killed, cannot pull its image, cannot mount a volume or cannot be scheduled makes
   Degraded=True with the reason and message; so does the Deployment's ReplicaFailure
   (``FailedCreate``: quota, admission webhook, Pod Security); a failed download makes Degraded=True too, and ModelReady says Downloading (bytes) / Loading / Ready
   (``model_status``);
5. write the status subresource only when it changed.

A watch event of a Deployment, Service or PDB version that a completed pass has already read (the echo
of the operator's own write, or one delivered while a pass read it) starts no pass (``observed``).

API errors raise ``kopf.TemporaryError`` with exponential backoff (1, 2, 4 … 60 s). The
InferenceService's spec and user metadata are never written; kopf's handler progress (written only
when a handler retries or fails) lives in annotations with the ``kopf.serving.kvfleet.dev`` prefix
(survives structural-schema pruning), its last-handled essence in memory (``diffbase``).
No per-object state outlives a pass: the lock of an object exists only while a pass holds or
awaits it.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf

from . import api, apply, cache, child_write, diffbase, kube, memory, metrics, model_status, observed, peering, pods, render, resolve, \
    quiet_log, routing, routing_sync, strict, weights
from . import status as st

KOPF_PREFIX = "kopf.serving.kvfleet.dev"
FINALIZER = "serving.kvfleet.dev/kopf-finalizer"
CHILD_FILTER = {"app.kubernetes.io/managed-by": render.MANAGED_BY}
MANAGED = ",".join(f"{k}={v}" for k, v in CHILD_FILTER.items())  # the same, as a label selector
CHILDREN = (("deployment", "apps/v1", "deployments"), ("service", "v1", "services"),
            ("pdb", "policy/v1", "poddisruptionbudgets"))
CHILD_PLURALS = tuple(plural for _, _, plural in CHILDREN)  # named after their InferenceService (``observed``)
CHILD_EVENT_ATTEMPTS = 6  # backoff 1+2+4+8+16+32 s before giving up on a child event
CHILD_FAILURE_REPORTED_AT_RETRY = 1  # a child write failing twice in a row is Degraded (one blip is not)
CHILD_WRITE_REASONS = ("ChildCreateFailed", "ChildUpdateFailed")
POD_WARNINGS = "type=Warning,involvedObject.kind=Pod"  # server-side filter of the Events watch
SERVING_DEFAULTS = render.ServingDefaults.from_env(dict(os.environ))  # the chart's servingImage, servingDefaults
ROUTING_DEFAULTS = routing.RoutingDefaults.from_env(dict(os.environ))  # the chart's routing.endpointPickerImage
DIFFBASE = diffbase.MemoryDiffBaseStorage()  # kopf's last-handled essence per InferenceService (``configure``)


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf settings the operator relies on (also applied by tests)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    global DIFFBASE
    DIFFBASE = settings.persistence.diffbase_storage = diffbase.MemoryDiffBaseStorage()  # a start knows nothing
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # Kubernetes Events only for warnings and errors
    settings.posting.reporting_component = "kvfleet-operator"
    # watch only the operator's own children (server-side filter; big clusters have many Deployments)
    for selector in (("apps", "v1", "deployments"), ("v1", "services"), ("policy", "v1", "poddisruptionbudgets"),
                     ("v1", "pods"), ("inference.networking.k8s.io", "v1", "inferencepools"),
                     ("gateway.networking.k8s.io", "v1", "httproutes"), ("batch", "v1", "jobs")):
        settings.watching.label_selectors[selector] = MANAGED
    settings.watching.field_selectors[("v1", "events")] = POD_WARNINGS
    quiet_log.install(WATCH_HANDLERS)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    configure(settings)
    for what in await peering.ensure_peering_objects(settings):
        logger.info(f"Created peering object {what}")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else KUBECONFIG (~/.kube/config)."""
    return kube.login(**kwargs)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    await kube.close_client()


@dataclasses.dataclass
class _Lock:
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    users: int = 0  # passes holding or awaiting it
    queued: int = 0  # child-event passes (no only_if) awaiting it
    # the ``news`` of the passes dropped for a queued one (None: an event that always needs a pass): the
    # next queued pass to hold the lock runs if any of them, or its own, says so
    dropped: list[Callable[[], bool] | None] = dataclasses.field(default_factory=list)


_locks: dict[tuple[int, str, str], _Lock] = {}


@contextlib.asynccontextmanager
async def object_lock(namespace: str, name: str, queued: bool = False) -> AsyncIterator[_Lock]:
    """Hold the lock that serialises one InferenceService's passes (reconcile, autoscaler apply).

    The entry exists only while a pass holds or awaits it, so nothing is kept per object between
    passes or after its deletion (the map's size is the number of objects being worked on).
    ``queued``: counted in ``_Lock.queued`` while it waits (a child event's pass, see ``reconcile``)."""
    key = (id(asyncio.get_running_loop()), namespace, name)
    entry = _locks.setdefault(key, _Lock())
    entry.users += 1
    entry.queued += queued
    try:
        try:
            await entry.lock.acquire()
        finally:
            entry.queued -= queued
        try:
            yield entry
        finally:
            entry.lock.release()
    finally:
        entry.users -= 1
        if entry.users == 0:
            del _locks[key]


class Degraded(Exception):
    """Raised by ``reconcile`` after it reported Degraded=True (the reason is in the status).

    ``retryable``: retry with backoff (the cause is outside the spec) rather than wait for a spec change."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


def _queued_pass(namespace: str, name: str) -> _Lock | None:
    """The lock entry of ``namespace/name`` if a child-event pass already waits for it."""
    entry = _locks.get((id(asyncio.get_running_loop()), namespace, name))
    return entry if entry is not None and entry.queued > 0 else None


class _ChildExists(Exception):
    """A create of a child that no pass or watch event had seen (so it was not read) was answered 409."""


async def reconcile(namespace: str, name: str, logger: logging.Logger | logging.LoggerAdapter, retry: int = 0,
                    only_if: Callable[[dict[str, Any]], bool] | None = None,
                    coalesce: bool = False, news: Callable[[], bool] | None = None) -> dict[str, Any]:
    """One reconcile pass of InferenceService ``namespace/name``; returns the status patch written
    ({} if none, or if the object is gone, being deleted, or fails ``only_if``).

    Everything is read under the object's lock: the InferenceService first, then its children, so
    the status reflects one consistent view. ``retry``: how many passes in a row failed before
    this one (kopf's retry count): from ``CHILD_FAILURE_REPORTED_AT_RETRY`` on, a child write the
    API server refuses is reported in the status. ``only_if(fresh_object)``: skip the pass unless
    true (a trigger that matters only in some states). ``coalesce``: a child event's pass, which is
    dropped when another such pass already waits for the lock: that one reads everything after this
    event and so covers it (a burst of a rollout's events costs one queued pass, not one each); it
    runs unless its own ``news`` and those of the passes dropped for it all say no. ``news()``: asked
    once the lock is held, before any request; False skips the pass (a child event whose version a
    pass completed since has read: ``observed.pending``).

    Raises Degraded (spec unrealisable or child conflict, already reported) or kube.ApiError (a
    child write refused, reported once persistent; any other API failure)."""
    client = kube.get_client()
    started = time.monotonic()
    queue = coalesce and only_if is None
    waiting = _queued_pass(namespace, name) if queue else None
    if waiting is not None:
        if None not in waiting.dropped:
            waiting.dropped.append(news)
        metrics.RECONCILES.labels(result="coalesced").inc()
        return {}
    async with object_lock(namespace, name, queued=queue) as entry:
        dropped: list[Callable[[], bool] | None] = []
        if queue:
            dropped, entry.dropped = entry.dropped, []
        if news is not None and not any(n is None or n() for n in [news, *dropped]):
            metrics.RECONCILES.labels(result="unchanged").inc()
            return {}
        obj = await _fresh(client, namespace, name, only_if)
        if obj is None:
            return {}
        try:
            try:
                written = await _reconcile(client, obj, namespace, name, logger, retry)
            except _ChildExists:  # start over once, reading the child this pass did not know of
                obj = await _fresh(client, namespace, name, only_if)
                if obj is None:
                    return {}
                written = await _reconcile(client, obj, namespace, name, logger, retry)
            metrics.RECONCILES.labels(result="success").inc()
            return written
        except render.Unrealisable as exc:
            metrics.RECONCILES.labels(result="degraded").inc()
            logger.error(f"Degraded ({exc.reason}): {exc.message}")
            await _write_status(client, obj, st.degraded_status(obj, exc.reason, exc.message, st.now_rfc3339()))
            raise Degraded(f"{exc.reason}: {exc.message}", exc.retryable) from None
        except kube.ApiError as exc:
            metrics.RECONCILES.labels(result="error").inc()
            metrics.ERRORS.labels(reason=exc.reason).inc()
            raise
        finally:
            metrics.DURATION.observe(time.monotonic() - started)


async def _fresh(client: kube.KubeClient, namespace: str, name: str,
                 only_if: Callable[[dict[str, Any]], bool] | None) -> dict[str, Any] | None:
    """The InferenceService as the API server has it now; None when it is gone or going (the garbage
    collector removes the children: nothing to reconcile) or fails ``only_if``."""
    obj = await client.get(api.API_VERSION, api.PLURAL, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        observed.forget(namespace, name, CHILD_PLURALS)
        return None
    return obj if only_if is None or only_if(obj) else None


async def _reconcile(client: kube.KubeClient, obj: dict[str, Any], namespace: str, name: str,
                     logger: logging.Logger | logging.LoggerAdapter, retry: int) -> dict[str, Any]:
    spec = render.parse_spec(obj)
    version = strict.kubernetes_version(await client.server_version())  # the children's schema
    children = render.render(obj, defaults=SERVING_DEFAULTS, routing_defaults=ROUTING_DEFAULTS,
                             kubernetes_version=version)  # Unrealisable first, before any request
    pins = await weights.pin_sources(obj, spec)  # once per generation; Unrealisable names the field
    uid = obj["metadata"].get("uid")
    # a child no pass and no watch event has seen is not read: it is created, and a 409 starts over
    unread = {kind for kind, _, plural in CHILDREN if not observed.known(namespace, name, plural)}
    live = {kind: None if kind in unread else await client.get(av, plural, namespace, name)
            for kind, av, plural in CHILDREN}
    for kind, _, plural in CHILDREN:
        observed.seen(namespace, name, plural, live[kind])
    live_replicas = ((live["deployment"] or {}).get("spec") or {}).get("replicas") \
        if spec.autoscaling.enabled else None
    replicas = render.desired_replicas(spec, live_replicas, (obj.get("status") or {}).get("desiredReplicas"))
    desired = {"deployment": children.deployment, "service": children.service, "pdb": children.pdb}
    ours = {kind: body is not None and (apply.controlled_by(body, uid) or apply.adoptable(body, render.OWNER_LABEL, name))
            for kind, body in live.items()}
    for kind, body in live.items():
        if body is not None and desired[kind] is not None and not ours[kind]:
            raise render.Unrealisable(
                "ChildConflict", f"{body.get('kind', kind)} {namespace}/{name} exists and is not controlled by "
                                 f"this InferenceService; delete or rename it", retryable=True)
    plan = await weights.prepare(client, obj, spec, pins, live["deployment"], SERVING_DEFAULTS,
                                 lambda: _being_deleted(client, namespace, name), logger)
    children = render.with_replicas(render.render(
        obj, defaults=SERVING_DEFAULTS, routing_defaults=ROUTING_DEFAULTS, kubernetes_version=version,
        pins=plan.serving or pins, hf_endpoint=resolve.hf_endpoint()), replicas)
    desired = {"deployment": children.deployment, "service": children.service, "pdb": children.pdb}
    result: dict[str, Any] = {}
    template_written = False
    failure: tuple[str, str] | None = None  # (reason, message) of the first child write refused
    error: kube.ApiError | None = None
    for kind, av, plural in CHILDREN:
        want, have = desired[kind], live[kind]
        if kind == "deployment" and plan.serving is None:  # its weights are still downloading: leave it as it is
            result[kind] = have
            continue
        action, body = ("delete", None) if want is None else apply.plan(want, have)
        if want is None and (have is None or not ours[kind]):
            continue
        what = (want or have or {}).get("kind", kind)
        try:
            result[kind] = await child_write.write(client, logger, action, body, have, av, plural, namespace,
                                                   name, what, label=kind)
            observed.seen(namespace, name, plural, result[kind])
        except kube.ApiError as exc:
            if exc.status == 409 and kind in unread:
                observed.seen(namespace, name, plural, {})
                raise _ChildExists() from None
            logger.warning(f"{action} of {what} {namespace}/{name} failed: {exc}")
            result[kind] = have
            if error is None:
                error = exc
                failure = ("ChildCreateFailed" if action == "create" else "ChildUpdateFailed",
                           f"{action} of {what} {namespace}/{name} refused by the API server "
                           f"({exc.status} {exc.reason}): {exc.message}; retrying with backoff")
            continue
        if kind == "deployment" and body is not None:
            template_written = action == "create" or "template" in (body.get("spec") or {})
    routed = await routing_sync.sync(client, obj, spec, children.routing, logger)
    selector = render.selector_string(name)
    # the first pass of a new object lists no pods once it created the Deployment: none can be its pods
    # yet (no ReplicaSet exists); the Deployment's status events start the passes that do. (A Deployment
    # re-created later may adopt the orphaned ReplicaSet of a `--cascade=orphan` delete: listed.)
    created = live["deployment"] is None and result.get("deployment") is not None \
        and not (obj.get("status") or {}).get("observedGeneration")
    serving_pods = [] if created else [
        p for p in await client.list("v1", "pods", namespace, label_selector=selector,
                                     not_older_than=kube.seen("pods"))
        if all((p.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in render.selector_labels(name).items())]
    events = [e for pod in pods.starting_pods(serving_pods)
              for e in await client.list("v1", "events", namespace, field_selector=pods.event_selector(pod))]
    downloads = await weights.observe(client, obj, spec, plan, serving_pods)
    old_degraded = st.get_condition(obj.get("status"), st.DEGRADED) or {}
    report = failure is not None and (retry >= CHILD_FAILURE_REPORTED_AT_RETRY or
                                      old_degraded.get("reason") in CHILD_WRITE_REASONS)
    problem = (failure if report else None) or model_status.download_problem(downloads, spec) \
        or pods.pod_problem(serving_pods, events)
    now = st.now_rfc3339()
    new = st.compute_status(obj, result.get("deployment"), replicas,
                            render.service_url(name, namespace, spec.service.port), plan.status,
                            selector, now, spec.autoscaling.enabled, template_written, problem)
    ready = (st.get_condition(new, st.READY) or {}).get("status") == "True"
    new["conditions"] = st.set_condition(
        new["conditions"], model_status.MODEL_READY,
        *model_status.condition(downloads, serving_pods, ready, plan.status["revision"],
                                per_pod=bool(cache.downloaded(spec)) and spec.model_cache.shared is None),
        now, obj["metadata"].get("generation"))
    old_routing = (obj.get("status") or {}).get("routing")
    if routed is not None or old_routing is not None:
        new["routing"] = routing_sync.status_value(old_routing, routed)
    if spec.adapters or (obj.get("status") or {}).get("adapters") is not None:
        new["adapters"] = pods.adapter_counts([a.name for a in spec.adapters], serving_pods,
                                              render.ADAPTERS_ANNOTATION) if spec.adapters else None
    written = await _write_status(client, obj, new)
    if error is not None:
        raise error
    observed.accounted(namespace, name, {plural: result.get(kind) for kind, _, plural in CHILDREN})
    return written


async def _being_deleted(client: kube.KubeClient, namespace: str, name: str) -> bool:
    """Whether the InferenceService is gone or has a deletionTimestamp *now* (``weights.prepare`` asks
    before it creates a claim or a download Job for an object queued behind the lock)."""
    fresh = await client.get(api.API_VERSION, api.PLURAL, namespace, name)
    return fresh is None or bool(fresh.get("metadata", {}).get("deletionTimestamp"))


async def _write_status(client: kube.KubeClient, obj: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Write the difference between ``obj``'s status and ``new`` (a complete status); returns the patch."""
    patch = st.status_patch(obj.get("status"), new)
    meta = obj["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    if patch:
        observed.reported(namespace, name, None)
        await client.patch(api.API_VERSION, api.PLURAL, meta.get("namespace"), name, {"status": patch},
                           subresource="status")
    observed.reported(namespace, name, _pod_failure_reported({"status": new}))
    return patch


def _backoff(retry: int) -> float:
    return float(min(60, 2 ** retry))


@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL, id="reconcile")
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, id="reconcile")
async def reconcile_handler(body: kopf.Body, retry: int, logger: logging.Logger, **_: Any) -> None:
    """Reconcile on create (also every object after the operator starts) / update; permanent failure for
    unrealisable specs."""
    meta = body.get("metadata", {})
    try:
        await reconcile(meta.get("namespace") or "default", meta["name"], logger, retry)
    except Degraded as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=_backoff(retry)) from None
        raise kopf.PermanentError(str(exc)) from None
    except kube.ApiError as exc:
        raise kopf.TemporaryError(f"API error, retrying: {exc}", delay=_backoff(retry)) from None


def plain_copy(body: Any) -> dict[str, Any]:
    """A deep, mutable copy of kopf's body."""
    return copy.deepcopy(dict(body))


async def _child_event(namespace: str | None, owner: str | None, logger: logging.Logger,
                       only_if: Callable[[dict[str, Any]], bool] | None = None,
                       news: Callable[[], bool] | None = None) -> None:
    """Reconcile InferenceService ``namespace/owner`` after one of its children changed, retrying API
    errors with backoff (``CHILD_EVENT_ATTEMPTS``). ``news``: see ``reconcile`` (first attempt only: a
    failed pass may have read the versions it asks about)."""
    if owner is None or namespace is None:
        return
    for attempt in range(CHILD_EVENT_ATTEMPTS):
        try:
            await reconcile(namespace, owner, logger, retry=attempt, only_if=only_if, coalesce=attempt == 0,
                            news=news if attempt == 0 else None)
            return
        except Degraded:
            return  # reported in the owner's status; kopf's handler retries or waits for a spec change
        except kube.ApiError as exc:
            delay = _backoff(attempt)
            logger.warning(f"reconcile of {namespace}/{owner} after a child change failed, "
                           f"retrying in {delay:g} s: {exc}")
            await asyncio.sleep(delay)
    logger.error(f"giving up on {namespace}/{owner} after {CHILD_EVENT_ATTEMPTS} attempts; "
                 f"the next change or operator restart reconciles it")


def _pod_failure_reported(owner: dict[str, Any]) -> bool:
    """Whether the (fresh) owner's Degraded condition names a pod failure, which a healthy pod's event may
    have cleared (readiness changes reach the status through the Deployment's own events)."""
    degraded = st.get_condition(owner.get("status"), st.DEGRADED) or {}
    return degraded.get("status") == "True" and degraded.get("reason") in pods.REASONS


@kopf.on.event("", "v1", "pods", labels=CHILD_FILTER)
async def pod_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A serving pod changed: a failure (crash loop, OOM kill, image pull, unschedulable) reaches the
    owner's status within one reconcile, and so does its recovery. A model-download pod's changes (it
    starts, finishes, fails: a few per download) always do: ModelReady follows them."""
    meta = body.get("metadata", {})
    kube.saw("pods", meta.get("resourceVersion"))  # before the pass: its lists must reflect this event
    labels = meta.get("labels") or {}
    namespace, owner = meta.get("namespace"), labels.get(render.OWNER_LABEL)
    if labels.get("app.kubernetes.io/component") == cache.DOWNLOAD_COMPONENT:
        await _child_event(namespace, owner, logger)
        return
    if pods.pod_problem([plain_copy(body)]) is not None:
        await _child_event(namespace, owner, logger)
        return
    # a healthy pod matters only if the owner's status names a pod failure that may have cleared: when
    # this process wrote that status it knows without reading it (asked under the owner's lock)
    await _child_event(namespace, owner, logger, only_if=_pod_failure_reported,
                       news=lambda: observed.pod_failure_reported(namespace, owner) is not False)


def _volume_warning(body: kopf.Body, **_: Any) -> bool:
    return body.get("reason") in pods.VOLUME_REASONS and (body.get("involvedObject") or {}).get("kind") == "Pod"


@kopf.on.event("", "v1", "events", when=_volume_warning)
async def volume_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A pod's volume does not attach (Multi-Attach) or mount: when the pod is a serving pod (labelled
    as ours; one list by name), reconcile its owner, which reads the pod's Events."""
    ref = body.get("involvedObject") or {}
    namespace = ref.get("namespace") or body.get("metadata", {}).get("namespace")
    if not namespace or not ref.get("name"):
        return
    client = kube.get_client()
    found = await client.list("v1", "pods", namespace, label_selector=MANAGED,
                              field_selector=f"metadata.name={ref['name']}")
    for pod in found:
        await _child_event(namespace, (pod["metadata"].get("labels") or {}).get(render.OWNER_LABEL), logger)


def _controller(body: kopf.Body) -> tuple[str | None, str | None]:
    """(namespace, name) of the InferenceService controlling a child (None when it has none)."""
    meta = body.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == api.KIND and ref.get("apiVersion", "").startswith(api.GROUP):
            return meta.get("namespace"), ref.get("name")
    return meta.get("namespace"), None


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def isvc_event(body: kopf.Body, event: dict[str, Any], **_: Any) -> None:
    """An InferenceService is gone (its children follow by garbage collection): once a pass in flight
    is over, forget what is known of it and, once a burst of deletions is over, give the freed memory
    back to the operating system (``memory``). Or its status changed: when it does not say what this
    process last wrote about pod failures (a peer operator or a user wrote it), forget that record."""
    meta = body.get("metadata", {})
    namespace, name = meta.get("namespace") or "default", meta.get("name", "")
    if event.get("type") == "DELETED":
        async with object_lock(namespace, name):
            observed.forget(namespace, name, CHILD_PLURALS)
        DIFFBASE.forget(meta.get("uid"))
        memory.trim_soon()
    elif observed.pod_failure_reported(namespace, name) not in (None, _pod_failure_reported(body)):
        observed.reported(namespace, name, None)  # only ever costs a read of the status


async def _named_child_event(body: kopf.Body, event: dict[str, Any], plural: str, logger: logging.Logger) -> None:
    """A Deployment, Service or PDB named after its controlling InferenceService changed: reconcile the
    owner unless a pass has already read this version (``observed``: the echo of the operator's own
    write, or an event delivered while a pass read it)."""
    namespace, owner = _controller(body)
    meta = body.get("metadata", {})
    if owner is None or namespace is None or meta.get("name") != owner:
        await _child_event(namespace, owner, logger)
        return
    if not observed.watched(namespace, owner, plural, meta.get("resourceVersion"), event.get("type") == "DELETED"):
        metrics.RECONCILES.labels(result="unchanged").inc()
        return
    await _child_event(namespace, owner, logger, news=lambda: observed.pending(namespace, owner, CHILD_PLURALS))


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
async def deployment_event(body: kopf.Body, event: dict[str, Any], logger: logging.Logger, **_: Any) -> None:
    """An owned Deployment changed (rollout progress, ReplicaFailure, edits, deletion): reconcile its owner."""
    await _named_child_event(body, event, "deployments", logger)


@kopf.on.event("", "v1", "services", labels=CHILD_FILTER)
async def service_event(body: kopf.Body, event: dict[str, Any], logger: logging.Logger, **_: Any) -> None:
    """An owned Service changed or was deleted: reconcile its owner."""
    await _named_child_event(body, event, "services", logger)


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_FILTER)
async def job_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned model-download Job changed (started, succeeded, failed, deleted): reconcile its owner, which
    creates or moves the Deployment once the weights are there."""
    await _child_event(*_controller(body), logger)


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, id="model-progress", interval=weights.PROGRESS_INTERVAL_S,
            when=weights.downloading)
async def model_progress(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """While ModelReady says Downloading, reconcile every PROGRESS_INTERVAL_S: its message follows the bytes."""
    meta = body.get("metadata", {})
    try:
        await reconcile(meta.get("namespace") or "default", meta["name"], logger)
    except (Degraded, kube.ApiError) as exc:  # reported in the status, or retried at the next tick
        logger.debug(f"progress reconcile: {exc}")


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_FILTER)
async def pdb_event(body: kopf.Body, event: dict[str, Any], logger: logging.Logger, **_: Any) -> None:
    """An owned PodDisruptionBudget changed or was deleted: reconcile its owner."""
    await _named_child_event(body, event, "poddisruptionbudgets", logger)


@kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", labels=CHILD_FILTER)
async def inference_pool_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned InferencePool changed or was deleted (kopf watches it once its CRD exists): reconcile its owner."""
    await _child_event(*_controller(body), logger)


@kopf.on.event("gateway.networking.k8s.io", "v1", "httproutes", labels=CHILD_FILTER)
async def http_route_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned HTTPRoute changed or was deleted: reconcile its owner."""
    await _child_event(*_controller(body), logger)


# kopf.on.event handlers: one call per watch event, whose success kopf logs at INFO (``quiet_log``)
WATCH_HANDLERS = tuple(fn.__name__ for fn in (pod_event, volume_event, isvc_event, deployment_event, service_event,
                                              job_event, pdb_event, inference_pool_event, http_route_event))
