"""kopf handlers: thin glue around read -> render -> apply -> status.

Triggers: an InferenceService is created, its spec/metadata changes, or the operator (re)starts
(resume); an owned Deployment/Service/PodDisruptionBudget/model-download Job changes or is deleted
(every ``weights.PROGRESS_INTERVAL_S`` while a model downloads, for its progress) (the event names
its controller InferenceService, which is then reconciled); a serving pod starts or stops failing
(its ``serving.kvfleet.dev/inferenceservice`` label names the owner; ``pods.pod_problem``). One pass (``reconcile``):

1. parse and render the spec (pure); a spec that cannot be realised -> status Degraded=True with
   reason and message, no child touched, ``kopf.PermanentError`` (no retry until the spec changes);
   the hf:// and s3:// model sources are pinned once per generation (``weights.pin_sources``);
2. read the live children; one that exists but is controlled by something else, or is not labelled
   as this InferenceService's, is a conflict (Degraded ``ChildConflict``, retried with backoff so
   that removing the object in the way is enough) — the operator never takes over objects it did
   not create; orphans it did create (``--cascade=orphan``) are adopted;
3. keep the model cache (``weights.prepare``: a shared cache's claim and download Jobs; the Deployment
   is neither created nor moved to new weights before they are downloaded);
   create or three-way merge-patch each child (``apply``), delete the PDB when no longer wanted; a
   child the API server refuses as invalid (422, e.g. a malformed affinity or toleration) is
   Degraded ``ChildInvalid`` with the server's message, permanent like an unrealisable spec;
4. list the serving pods: one that crash-loops, was OOM-killed, cannot pull its image or cannot be
   scheduled makes Degraded=True with the reason and the container's termination message, and so
   does a failed download; ModelReady says Downloading (bytes) / Loading / Ready (``model_status``);
5. write the status subresource only when it changed.

API errors raise ``kopf.TemporaryError`` with exponential backoff (1, 2, 4 … 60 s). The
InferenceService's spec and user metadata are never written; kopf's own state lives in
annotations with the ``kopf.serving.kvfleet.dev`` prefix (survives structural-schema pruning).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from typing import Any

import kopf

from . import api, apply, cache, kube, metrics, model_status, peering, pods, render, resolve, weights
from . import status as st

KOPF_PREFIX = "kopf.serving.kvfleet.dev"
FINALIZER = "serving.kvfleet.dev/kopf-finalizer"
CHILD_FILTER = {"app.kubernetes.io/managed-by": render.MANAGED_BY}
CHILDREN = (("deployment", "apps/v1", "deployments"), ("service", "v1", "services"),
            ("pdb", "policy/v1", "poddisruptionbudgets"))
CHILD_EVENT_ATTEMPTS = 6  # backoff 1+2+4+8+16+32 s before giving up on a child event
_locks: dict[tuple[int, str, str], asyncio.Lock] = {}
SERVING_DEFAULTS = render.ServingDefaults.from_env(dict(os.environ))  # the chart's servingImage


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf settings the operator relies on (also applied by tests)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # Kubernetes Events only for warnings and errors
    settings.posting.reporting_component = "kvfleet-operator"
    # watch only the operator's own children (server-side filter; big clusters have many Deployments)
    managed = ",".join(f"{k}={v}" for k, v in CHILD_FILTER.items())
    for selector in (("apps", "v1", "deployments"), ("v1", "services"), ("policy", "v1", "poddisruptionbudgets"),
                     ("v1", "pods"), ("batch", "v1", "jobs")):
        settings.watching.label_selectors[selector] = managed


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


def object_lock(namespace: str, name: str) -> asyncio.Lock:
    """The lock that serialises writes to one InferenceService's children (reconcile, autoscaler)."""
    key = (id(asyncio.get_running_loop()), namespace, name)
    if key not in _locks:
        _locks[key] = asyncio.Lock()
    return _locks[key]


class Degraded(Exception):
    """Raised by ``reconcile`` after it reported Degraded=True (the reason is in the status).

    ``retryable``: retry with backoff (the cause is outside the spec) rather than wait for a spec change."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


async def reconcile(obj: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    """One reconcile pass of InferenceService ``obj``; returns the status patch written ({} if none).

    Raises Degraded (spec unrealisable or child conflict, already reported) or kube.ApiError."""
    meta = obj["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    client = kube.get_client()
    started = time.monotonic()
    async with object_lock(namespace, name):
        try:
            written = await _reconcile(client, obj, namespace, name, logger)
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


async def _reconcile(client: kube.KubeClient, obj: dict[str, Any], namespace: str, name: str,
                     logger: logging.Logger | logging.LoggerAdapter) -> dict[str, Any]:
    if obj["metadata"].get("deletionTimestamp"):
        return {}  # being deleted: the garbage collector removes the children, nothing to reconcile
    spec = render.parse_spec(obj)
    children = render.render(obj, defaults=SERVING_DEFAULTS)  # surfaces Unrealisable before any request
    pins = await weights.pin_sources(obj, spec)  # once per generation; Unrealisable names the field
    uid = obj["metadata"].get("uid")
    live = {kind: await client.get(av, plural, namespace, name) for kind, av, plural in CHILDREN}
    live_replicas = ((live["deployment"] or {}).get("spec") or {}).get("replicas") \
        if spec.autoscaling.enabled else None
    replicas = render.desired_replicas(spec, live_replicas, (obj.get("status") or {}).get("desiredReplicas"))
    children = render.with_replicas(children, replicas)
    desired = {"deployment": children.deployment, "service": children.service, "pdb": children.pdb}
    ours = {kind: body is not None and (apply.controlled_by(body, uid) or _adoptable(body, name))
            for kind, body in live.items()}
    for kind, body in live.items():
        if body is not None and desired[kind] is not None and not ours[kind]:
            raise render.Unrealisable(
                "ChildConflict", f"{body.get('kind', kind)} {namespace}/{name} exists and is not controlled by "
                                 f"this InferenceService; delete or rename it", retryable=True)
    plan = await weights.prepare(client, obj, spec, pins, live["deployment"], SERVING_DEFAULTS,
                                 lambda: _being_deleted(client, namespace, name))
    children = render.with_replicas(render.render(obj, defaults=SERVING_DEFAULTS, pins=plan.serving or pins,
                                                  hf_endpoint=resolve.hf_endpoint()), replicas)
    desired["deployment"] = children.deployment
    result: dict[str, Any] = {}
    template_written = False
    for kind, av, plural in CHILDREN:
        want, have = desired[kind], live[kind]
        if kind == "deployment" and plan.serving is None:  # its weights are still downloading: leave it as it is
            result[kind] = have
            continue
        if want is None:
            if have is not None and ours[kind]:
                logger.info(f"Deleting {kind} {namespace}/{name} (no longer wanted)")
                await client.delete(av, plural, namespace, name)
                metrics.CHILD_WRITES.labels(kind=kind, action="delete").inc()
            continue
        action, body = apply.plan(want, have)
        if action == "create" and await _being_deleted(client, namespace, name):
            logger.info(f"Not creating {kind} {namespace}/{name}: the InferenceService is being deleted")
            return {}
        try:
            if action == "create":
                logger.info(f"Creating {kind} {namespace}/{name}")
                result[kind] = await client.create(av, plural, namespace, body)
            elif action == "patch":
                logger.info(f"Patching {kind} {namespace}/{name}: {sorted(body)}")
                result[kind] = await client.patch(av, plural, namespace, name, body)
            else:
                result[kind] = have
        except kube.ApiError as exc:
            if exc.status == 422:  # the rendered child is invalid: retrying cannot help, the spec must change
                raise render.Unrealisable("ChildInvalid", f"the API server refused the {want['kind']}: "
                                                          f"{exc.message}") from None
            raise
        if action != "noop":
            metrics.CHILD_WRITES.labels(kind=kind, action=action).inc()
        if kind == "deployment" and body is not None:
            template_written = action == "create" or "template" in (body.get("spec") or {})
    selector = render.selector_string(name)
    serving_pods = [p for p in await client.list("v1", "pods", namespace, label_selector=selector)
                    if all((p.get("metadata", {}).get("labels") or {}).get(k) == v
                           for k, v in render.selector_labels(name).items())]
    downloads = await weights.observe(client, obj, spec, plan, serving_pods)
    now = st.now_rfc3339()
    new = st.compute_status(obj, result["deployment"], replicas,
                            render.service_url(name, namespace, spec.service.port), plan.status,
                            selector, now, spec.autoscaling.enabled, template_written,
                            model_status.download_problem(downloads, spec) or pods.pod_problem(serving_pods))
    ready = (st.get_condition(new, st.READY) or {}).get("status") == "True"
    new["conditions"] = st.set_condition(
        new["conditions"], model_status.MODEL_READY,
        *model_status.condition(downloads, serving_pods, ready, plan.status["revision"],
                                per_pod=bool(cache.downloaded(spec)) and spec.model_cache.shared is None),
        now, obj["metadata"].get("generation"))
    return await _write_status(client, obj, new)


async def _being_deleted(client: kube.KubeClient, namespace: str, name: str) -> bool:
    """Whether the InferenceService is gone or has a deletionTimestamp *now*. ``obj`` may be older than
    the deletion (a pass queued behind the lock): re-reading before a create keeps the operator from
    recreating children the garbage collector is removing. Creates are rare, so is this GET."""
    fresh = await client.get(api.API_VERSION, api.PLURAL, namespace, name)
    return fresh is None or bool(fresh.get("metadata", {}).get("deletionTimestamp"))


def _adoptable(child: dict[str, Any], name: str) -> bool:
    """An orphan left by `kubectl delete --cascade=orphan` of an InferenceService of the same name:
    labelled as ours and without any controller. The apply then sets our ownerReference (adoption)."""
    meta = child.get("metadata") or {}
    has_controller = any(ref.get("controller") for ref in meta.get("ownerReferences") or [])
    return not has_controller and (meta.get("labels") or {}).get(render.OWNER_LABEL) == name


async def _write_status(client: kube.KubeClient, obj: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    patch = st.status_patch(obj.get("status"), new)
    if patch:
        meta = obj["metadata"]
        await client.patch(api.API_VERSION, api.PLURAL, meta.get("namespace"), meta["name"], {"status": patch},
                           subresource="status")
    return patch


def _backoff(retry: int) -> float:
    return float(min(60, 2 ** retry))


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL, id="reconcile")
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL, id="reconcile")
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, id="reconcile")
async def reconcile_handler(body: kopf.Body, retry: int, logger: logging.Logger, **_: Any) -> None:
    """Reconcile on create / update / resume; permanent failure for unrealisable specs."""
    try:
        await reconcile(plain_copy(body), logger)
    except Degraded as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=_backoff(retry)) from None
        raise kopf.PermanentError(str(exc)) from None
    except kube.ApiError as exc:
        raise kopf.TemporaryError(f"API error, retrying: {exc}", delay=_backoff(retry)) from None


def plain_copy(body: Any) -> dict[str, Any]:
    """A deep, mutable copy of kopf's body."""
    return copy.deepcopy(dict(body))


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == api.KIND and ref.get("apiVersion", "").startswith(api.GROUP):
            return ref.get("name")
    return None


async def _child_event(body: kopf.Body, logger: logging.Logger, owner: str | None = None,
                       only_if_pods_matter: bool = False) -> None:
    owner = owner or _owner_name(body)
    namespace = body.get("metadata", {}).get("namespace")
    if owner is None:
        return
    client = kube.get_client()
    for attempt in range(CHILD_EVENT_ATTEMPTS):
        try:
            obj = await client.get(api.API_VERSION, api.PLURAL, namespace, owner)
            if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
                return  # the owner is going away; the garbage collector removes the children
            if only_if_pods_matter and not _pods_matter(body, obj):
                return
            await reconcile(obj, logger)
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


def _pods_matter(pod: kopf.Body, owner: dict[str, Any]) -> bool:
    """A pod event needs a reconcile when the pod fails now, or when the owner's Degraded condition
    names a pod failure that may have cleared (readiness changes reach the status through the
    Deployment's own events)."""
    degraded = st.get_condition(owner.get("status"), st.DEGRADED) or {}
    return pods.pod_problem([dict(pod)]) is not None or \
        (degraded.get("status") == "True" and degraded.get("reason") in pods.REASONS)


@kopf.on.event("", "v1", "pods", labels=CHILD_FILTER)
async def pod_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A serving pod changed: a failure (crash loop, OOM kill, image pull, unschedulable) reaches the
    owner's status within one reconcile, and so does its recovery. A model-download pod's changes (it
    starts, finishes, fails: a few per download) always do: ModelReady follows them."""
    labels = body.get("metadata", {}).get("labels") or {}
    await _child_event(body, logger, owner=labels.get(render.OWNER_LABEL),
                       only_if_pods_matter=labels.get("app.kubernetes.io/component") != cache.DOWNLOAD_COMPONENT)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_FILTER)
async def deployment_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned Deployment changed (rollout progress, edits, deletion): reconcile its owner."""
    await _child_event(body, logger)


@kopf.on.event("", "v1", "services", labels=CHILD_FILTER)
async def service_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned Service changed or was deleted: reconcile its owner."""
    await _child_event(body, logger)


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_FILTER)
async def job_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned model-download Job changed (started, succeeded, failed, deleted): reconcile its owner, which
    creates or moves the Deployment once the weights are there."""
    await _child_event(body, logger)


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, id="model-progress", interval=weights.PROGRESS_INTERVAL_S,
            when=weights.downloading)
async def model_progress(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """While ModelReady says Downloading, reconcile every PROGRESS_INTERVAL_S: its message follows the bytes."""
    try:
        await reconcile(plain_copy(body), logger)
    except (Degraded, kube.ApiError) as exc:  # reported in the status, or retried at the next tick
        logger.debug(f"progress reconcile: {exc}")


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_FILTER)
async def pdb_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """An owned PodDisruptionBudget changed or was deleted: reconcile its owner."""
    await _child_event(body, logger)
