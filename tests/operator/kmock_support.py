"""Test support: run the real kopf operator against KMock's Kubernetes emulator on 127.0.0.1.

Pieces (reused by the autoscaler's tests):

- ``ApiServerEmulator`` — a small ``kmock.KubernetesEmulator`` subclass (see its docstring for the
  real-API behaviours it stands in for), plus ``writes``: every non-GET request it served, with its
  Authorization header (the operator's kubeconfig token is ``OPERATOR_TOKEN``; the tests' own client
  uses another, so a test can tell who wrote what).
- ``register_resources(emulator)`` — the discovery entries kopf needs: InferenceService (status and
  scale subresources), Deployments, Services, PDBs, Pods, Jobs, PersistentVolumeClaims, Events, and —
  without which kopf discovers the resource but silently never watches it — CRDs and Namespaces.
- ``write_kubeconfig(path, url)`` — a kubeconfig with a dummy token pointing at the emulator
  (the operator's login handler reads it through KUBECONFIG, as on a laptop).
- ``operator_runner(*modules)`` — a ``kopf.testing.KopfRunner`` running ``kopf run -A --standalone``
  with the given modules (default: kvfleet_operator.handlers) and short timeouts; cluster-wide
  because KMock cannot parse the namespace listing kopf issues in namespaced mode.
- ``wait_for(predicate)`` — poll an async or sync predicate without long sleeps.
- ``assert_operator_never_wrote_spec(writes)`` — over every write made with the operator's token:
  InferenceServices got only status patches and kopf's own metadata patches (no ``/scale``, no
  JSON patch, no PUT/POST, no ``spec`` key anywhere).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import kmock
from kmock._internal.dicts import patch_dict
import kopf
from kopf.testing import KopfRunner

from kvfleet_operator import api, handlers

ISVC = f"{api.GROUP}/{api.VERSION}/{api.PLURAL}"


def _match_selector(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: a=b, a==b, a!=b, a, !a (comma = AND)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _match_fields(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based field selectors: a.b=v, a.b==v, a.b!=v (comma = AND; absent fields are '')."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        path, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        found: Any = obj
        for part in path.strip().split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if (str(found if found is not None else "") == value.strip()) == negate:
            return False
    return True


def _selected(obj: dict[str, Any], params: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return _match_selector(labels, params.get("labelSelector") or "") and \
        _match_fields(obj, params.get("fieldSelector") or "")


class ApiServerEmulator(kmock.KubernetesEmulator):
    """KMock's emulator plus the object bookkeeping of a real API server that kopf relies on.

    Stands in for: metadata.uid, metadata.creationTimestamp and metadata.generation = 1 on create;
    metadata.resourceVersion bumped on every write (kopf's JSON patches test it); metadata.generation
    incremented when a write changes ``spec``; the status subresource accepting only ``status``
    (and the main resource ignoring ``status`` changes, as for CRDs with a status subresource);
    ``labelSelector`` and equality-based ``fieldSelector`` (dotted paths, e.g. ``metadata.name=x``,
    ``involvedObject.name=p,type=Warning``) honoured on list and watch; the garbage collector's cascade:
    when an object is deleted, the objects whose ownerReferences name its uid are deleted too
    (recursively; as the controller-manager's garbage collector does with background propagation — only
    for owners deleted through this API, so fixtures may reference owners that were never created).
    ``inject_fault`` makes chosen requests fail (as an overloaded or flaky API server does, or one that
    refuses some objects: a full Service IP range, a quota) to exercise retries and their reporting;
    ``inject_delay`` makes chosen requests answer late (a loaded API server), to open the races a real
    one shows. Still absent (kept for e2e/): schema defaulting and validation, server-side apply.
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1000)
        self.writes: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.delays: list[dict[str, Any]] = []

    def inject_fault(self, method: str, plural: str, times: int = 1, status: int = 500,
                     names: set[str] | None = None, message: str | None = None) -> None:
        """Make the next ``times`` METHOD requests on ``plural`` (only for objects named in ``names``,
        when given) fail with HTTP ``status`` and ``message`` (API error paths)."""
        self.faults.append({"method": method.upper(), "plural": plural, "left": times, "status": status,
                            "names": names, "message": message or f"injected by the test ({status})"})

    def inject_delay(self, method: str, plural: str, seconds: float) -> None:
        """Answer every METHOD request on ``plural`` (watches excepted) ``seconds`` late."""
        self.delays.append({"method": method.upper(), "plural": plural, "seconds": seconds})

    @staticmethod
    def _target(request: Any) -> str | None:
        if request.name:
            return request.name
        return ((request.data or {}).get("metadata") or {}).get("name") if isinstance(request.data, dict) else None

    def _stored(self, request: Any) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return dict(self.objects[key].raw)
        return None

    async def _handle(self, request: Any) -> Any:
        for delay in self.delays:
            if request.resource is not None and request.method.value == delay["method"] \
                    and request.resource.plural == delay["plural"] and request.action != kmock.action.WATCH:
                await asyncio.sleep(delay["seconds"])
        for fault in self.faults:
            if fault["left"] > 0 and request.resource is not None and request.method.value == fault["method"] \
                    and request.resource.plural == fault["plural"] \
                    and (fault["names"] is None or self._target(request) in fault["names"]):
                fault["left"] -= 1
                raise kmock.KubernetesError(status=fault["status"], reason="InjectedFault", message=fault["message"])
        if request.resource is not None and request.method.value not in ("GET", "HEAD"):
            self.writes.append({"method": request.method.value, "resource": request.resource.plural,
                                "namespace": request.namespace, "name": request.name,
                                "subresource": request.subresource, "data": copy.deepcopy(request.data),
                                "auth": request.headers.get("Authorization")})
        rv = str(next(self._rv))
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta["resourceVersion"] = rv
            request.data.pop("status", None) if request.resource.plural == api.PLURAL else None
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            old = self._stored(request)
            data = request.data
            if isinstance(data, dict):
                if request.subresource == "status":
                    for key in list(data):
                        if key != "status":
                            del data[key]
                elif request.resource.plural == api.PLURAL:
                    data.pop("status", None)
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = rv
                if old is not None and isinstance(data.get("spec"), dict) \
                        and request.subresource in (None, "scale"):
                    new_spec = patch_dict(old.get("spec") or {}, data["spec"])
                    if new_spec != (old.get("spec") or {}):
                        meta["generation"] = int(old.get("metadata", {}).get("generation") or 1) + 1
            elif isinstance(data, list):
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
        live_before = self._live_uids() if request.resource is not None and request.method.value != "GET" else None
        try:
            return await super()._handle(request)
        finally:
            if live_before is not None:
                await self._collect_garbage(live_before - self._live_uids())

    def _live_uids(self) -> set[str]:
        return {o.raw.get("metadata", {}).get("uid") for o in self._objects.values() if not o.deleted} - {None}

    async def _collect_garbage(self, gone: set[str]) -> None:
        """Delete (and announce to watchers) every object owned by a uid in ``gone``, then their dependents."""
        while gone:
            async with self._lock:
                doomed = [(key, o) for key, o in self._objects.items() if not o.deleted and any(
                    ref.get("uid") in gone for ref in o.raw.get("metadata", {}).get("ownerReferences") or [])]
                gone = set()
                for key, o in doomed:
                    raw = o.raw
                    o.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})
                    gone.add(raw.get("metadata", {}).get("uid"))
                gone.discard(None)

    async def _serve_list(self, request: Any) -> Any:
        result = await super()._serve_list(request)
        result["items"] = [o for o in result["items"] if _selected(o, request.params or {})]
        return result

    async def _serve_watch(self, request: Any) -> Any:
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and not _selected(event.get("object") or {}, request.params or {}):
                continue
            yield event


def register_resources(emulator: kmock.KubernetesEmulator) -> None:
    """Declare the API resources the operator discovers and watches."""
    verbs = {"list", "watch", "get", "create", "patch", "update", "delete"}
    r = emulator.resources
    r[ISVC] = kmock.ResourceInfo(kind=api.KIND, singular=api.SINGULAR, namespaced=True, verbs=verbs,
                                 shortnames=set(api.SHORT_NAMES), subresources={"status", "scale"})
    r["apps/v1/deployments"] = kmock.ResourceInfo(kind="Deployment", singular="deployment", namespaced=True,
                                                  verbs=verbs, subresources={"status", "scale"})
    r["v1/services"] = kmock.ResourceInfo(kind="Service", singular="service", namespaced=True, verbs=verbs,
                                          subresources={"status"})
    r["policy/v1/poddisruptionbudgets"] = kmock.ResourceInfo(kind="PodDisruptionBudget", singular="poddisruptionbudget",
                                                             namespaced=True, verbs=verbs, subresources={"status"})
    r["v1/pods"] = kmock.ResourceInfo(kind="Pod", singular="pod", namespaced=True, verbs=verbs,
                                      subresources={"status"})
    r["batch/v1/jobs"] = kmock.ResourceInfo(kind="Job", singular="job", namespaced=True, verbs=verbs,
                                            subresources={"status"})
    r["v1/persistentvolumeclaims"] = kmock.ResourceInfo(kind="PersistentVolumeClaim", singular="persistentvolumeclaim",
                                                        namespaced=True, verbs=verbs, subresources={"status"})
    r["v1/events"] = kmock.ResourceInfo(kind="Event", singular="event", namespaced=True, verbs=verbs)
    r["events.k8s.io/v1/events"] = kmock.ResourceInfo(kind="Event", singular="event", namespaced=True, verbs=verbs)
    r["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
        verbs={"list", "watch", "get"})
    r["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", singular="namespace", namespaced=False,
                                            verbs={"list", "watch", "get"})


OPERATOR_TOKEN = "test-token"


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig pointing at ``url`` with the dummy bearer token ``OPERATOR_TOKEN``."""
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "kmock",
           "clusters": [{"name": "kmock", "cluster": {"server": str(url).rstrip("/")}}],
           "users": [{"name": "kmock", "user": {"token": OPERATOR_TOKEN}}],
           "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}]}
    path.write_text(json.dumps(cfg))
    return path


def fast_settings() -> kopf.OperatorSettings:
    """kopf settings for tests: the operator's own, with short timeouts and retries."""
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    settings.watching.server_timeout = 10
    settings.watching.reconnect_backoff = 0.1
    settings.networking.error_backoffs = [0.1, 0.2, 0.5]
    settings.networking.request_timeout = 10
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 1.0
    settings.persistence.consistency_timeout = 1.0
    settings.background.cancellation_polling = 0.2
    settings.process.ultimate_exiting_timeout = 5
    return settings


@contextlib.asynccontextmanager
async def running_operator(*modules: str, settings: kopf.OperatorSettings | None = None) -> AsyncIterator[KopfRunner]:
    """Run the operator while the test's event loop keeps serving the emulator (enter/exit in a thread)."""
    runner = operator_runner(*modules, settings=settings)
    await asyncio.to_thread(runner.__enter__)
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)


def operator_runner(*modules: str, settings: kopf.OperatorSettings | None = None) -> KopfRunner:
    """KopfRunner for ``kopf run -A --standalone -m MODULE...`` (KUBECONFIG must point at the emulator)."""
    modules = modules or ("kvfleet_operator.handlers",)
    args = ["run", "-A", "--standalone", "--verbose"]
    for module in modules:
        args += ["-m", module]
    return KopfRunner(args, timeout=30, settings=settings or fast_settings())


async def wait_for(predicate: Callable[[], Any | Awaitable[Any]], timeout: float = 15.0,
                   interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns a truthy value; AssertionError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {getattr(predicate, '__name__', predicate)}")
        await asyncio.sleep(interval)


def _pointer(path: str) -> list[str]:
    """A JSON pointer (RFC 6901) as its unescaped segments: '/metadata/annotations/a~1b' -> [...]."""
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]] if path else []


def _touched(body: Any) -> list[list[str]]:
    """The paths a patch body writes: a merge patch's leaves, or a JSON patch's op paths
    (``test`` writes nothing; ``move``/``copy`` also name their ``from``)."""
    if isinstance(body, list):
        paths = []
        for op in body:
            if not isinstance(op, dict) or op.get("op") == "test":
                continue
            paths.append(_pointer(str(op.get("path", ""))))
            if op.get("op") == "move":
                paths.append(_pointer(str(op.get("from", ""))))
        return paths

    def leaves(obj: Any, prefix: list[str]) -> list[list[str]]:
        if isinstance(obj, dict) and obj:
            return [p for k, v in obj.items() for p in leaves(v, prefix + [k])]
        return [prefix]
    return leaves(body, [])


def assert_operator_never_wrote_spec(writes: list[dict[str, Any]]) -> None:
    """Every write to an InferenceService made with the operator's credentials is a patch (merge
    or JSON patch) of the status subresource that touches only ``status``, or a patch of kopf's
    own metadata (annotations under kopf.serving.kvfleet.dev, finalizers, the resourceVersion
    kopf's JSON patches carry). Anything else — the ``/scale`` subresource (it writes
    ``spec.replicas``), PUT or POST, a path under ``spec`` or the whole object, another
    subresource — fails, naming the write."""
    ours = [w for w in writes if w["resource"] == api.PLURAL and w["auth"] == f"Bearer {OPERATOR_TOKEN}"]
    assert ours, "the operator wrote no status at all"
    for w in ours:
        assert w["method"] == "PATCH" and isinstance(w["data"], (dict, list)), w
        assert w["subresource"] in (None, "status"), w
        for path in _touched(w["data"]):
            if path[:1] == ["metadata"] and path[1:2] == ["resourceVersion"]:
                continue
            if w["subresource"] == "status":
                assert path[:1] == ["status"] and len(path) >= 1, (path, w)
            elif path[:2] == ["metadata", "finalizers"]:
                continue
            else:
                assert path[:2] == ["metadata", "annotations"] and len(path) >= 3 \
                    and path[2].startswith("kopf.serving.kvfleet.dev"), (path, w)
