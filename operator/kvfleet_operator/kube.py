"""A small async Kubernetes REST client (aiohttp) for the reconcile and the autoscaler.

Objects are plain dicts (no typed models), patches are JSON merge patches. Credentials are those
the operator's kopf login handler found (``set_credentials``), or found the same way on first use:
the in-cluster service account, else KUBECONFIG / ~/.kube/config. A 401 re-reads them once (bound
service-account tokens rotate). Errors raise ``ApiError`` with the API's status code and message.

Sized for bursts (a restart or a ``kubectl apply`` of 1,000 InferenceServices reconciles them all at
once): at most ``POOL_SIZE`` requests are in flight on one pool of keep-alive connections; the others
queue for a connection without a deadline, and the timeouts bound only the work on the socket —
``CONNECT_TIMEOUT_S`` to open a connection, ``READ_TIMEOUT_S`` between two reads of an answer. (A
single total timeout, aiohttp's default, also counts the time spent queueing for the pool, so a
burst made requests time out inside the client before they were sent.)

Usage::

    client = kube.get_client()
    dep = await client.get("apps/v1", "deployments", "ns", "name")      # None when absent
    pods = await client.list("v1", "pods", "ns", label_selector="a=b")
    events = await client.list("v1", "events", "ns", field_selector="involvedObject.name=p,type=Warning")
    await client.patch("apps/v1", "deployments", "ns", "name", {"spec": {"replicas": 3}})
    await client.patch(API_VERSION, "inferenceservices", "ns", "name", {"status": {...}}, subresource="status")
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf

from . import metrics

POOL_SIZE = 64  # concurrent requests (the API server's default --max-requests-inflight is 400)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # a list of every pod in a big namespace can take seconds
_credentials: kopf.ConnectionInfo | None = None
STRICT = {"fieldValidation": "Strict"}  # writes: refuse unknown fields instead of dropping them with a warning
_clients: dict[int, "KubeClient"] = {}


class ApiError(Exception):
    """An API request failed: ``status`` (HTTP code), ``reason`` and ``message`` from the Status body."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Credentials as users expect them: in-cluster service account, else kubeconfig.

    A kubeconfig user without a token, certificate or password (an exec plugin such as
    gke-gcloud-auth-plugin or aws eks get-token) is resolved through the kubernetes client library."""
    kwargs.setdefault("settings", kopf.OperatorSettings())
    kwargs.setdefault("logger", logging.getLogger(__name__))
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None and not (info.token or info.certificate_path or info.certificate_data or info.username):
        try:
            info = kopf.login_via_client(**kwargs) or info
        except (kopf.LoginError, ImportError):
            pass
    set_credentials(info)
    return info


def set_credentials(info: kopf.ConnectionInfo | None) -> None:
    """Remember the credentials for clients created later (and refresh existing ones)."""
    global _credentials
    _credentials = info
    for client in _clients.values():
        client.info = info


def get_client() -> "KubeClient":
    """The client of the running event loop (one aiohttp session per loop)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(id(loop))
    if client is None or client.loop is not loop:
        client = _clients[id(loop)] = KubeClient(_credentials)
    return client


async def close_client() -> None:
    """Close the running loop's client (operator cleanup)."""
    client = _clients.pop(id(asyncio.get_running_loop()), None)
    if client is not None:
        await client.close()


def revision(resource_version: str | None) -> int:
    """An object's resourceVersion as a number to compare (the API server's versions are etcd revisions);
    0 when it has none or it is not a number."""
    try:
        return int(resource_version or 0)
    except ValueError:
        return 0


_seen: dict[str, int] = {}


def saw(plural: str, resource_version: str | None) -> None:
    """Record that this process observed a ``plural`` object (a watch event) at ``resource_version``."""
    _seen[plural] = max(_seen.get(plural, 0), revision(resource_version))


def seen(plural: str) -> int:
    """The newest resourceVersion of a ``plural`` object this process observed (0: none yet): a list of
    ``plural`` at least this new (``KubeClient.list(not_older_than=...)``) reflects every event the
    operator has acted on. The API server's watch cache of ``plural`` always reaches it, as it is one of
    that resource's own revisions (a revision of another resource may never come: its cache then answers
    504 "Too large resource version" after 3 s)."""
    return _seen.get(plural, 0)


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    """REST path, e.g. ('apps/v1', 'deployments', 'ns', 'x') -> /apis/apps/v1/namespaces/ns/deployments/x."""
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def resource_of(path: str) -> str:
    """The resource a REST path addresses, for metrics: '/api/v1/namespaces/ns/pods' -> 'pods',
    '/apis/g/v/namespaces/ns/things/x/status' -> 'things/status', '/version' -> 'version', '/apis/g/v' -> 'discovery'."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if not parts or parts[0] not in ("api", "apis"):
        return "/".join(parts) or "root"
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return "discovery"
    return rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")


class KubeClient:
    """Async JSON client of the Kubernetes API (pool size and timeouts: see the module docstring)."""

    def __init__(self, info: kopf.ConnectionInfo | None, pool_size: int = POOL_SIZE,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S):
        self.info = info
        self.pool_size = pool_size
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout_s,
                                             sock_read=read_timeout_s)
        self.loop = asyncio.get_running_loop()
        self._session: aiohttp.ClientSession | None = None
        self._tmp: list[str] = []
        self._version: str | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        info = self.info
        assert info is not None
        if not info.server.startswith("https"):
            return False
        if info.insecure:
            return False
        ca = info.ca_data
        if isinstance(ca, (bytes, str)) and not (ca.decode() if isinstance(ca, bytes) else ca).lstrip().startswith("-----"):
            ca = base64.b64decode(ca)
        ctx = ssl.create_default_context(cafile=os.fspath(info.ca_path) if info.ca_path else None,
                                         cadata=(ca.decode() if isinstance(ca, bytes) else ca) if ca else None)
        cert, key = info.certificate_path, info.private_key_path
        if info.certificate_data:
            cert = self._tempfile(info.certificate_data)
        if info.private_key_data:
            key = self._tempfile(info.private_key_data)
        if cert:
            ctx.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
        return ctx

    def _tempfile(self, data: str | bytes) -> str:
        raw = data.encode() if isinstance(data, str) else data
        if not raw.lstrip().startswith(b"-----"):
            raw = base64.b64decode(raw)
        fd, path = tempfile.mkstemp(prefix="kvfleet-kube-")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        self._tmp.append(path)
        return path

    def _headers(self) -> dict[str, str]:
        info = self.info
        assert info is not None
        if info.token:
            return {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"}
        if info.username and info.password:
            basic = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        for path in self._tmp:
            os.unlink(path)
        self._tmp.clear()

    async def request(self, method: str, path: str, *, params: dict[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json", _retry: bool = True) -> Any:
        """One API call; returns the decoded JSON body. Raises ApiError."""
        if self.info is None:
            login()
            self.info = _credentials
        if self.info is None:
            raise ApiError(401, "NoCredentials", "no in-cluster service account and no kubeconfig found")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=self.pool_size, limit_per_host=0),
                timeout=self.timeout)
        headers = {**self._headers(), "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            async with self._session.request(method, self.info.server.rstrip("/") + path, params=params,
                                             data=None if body is None else json.dumps(body),
                                             headers=headers) as rsp:
                status = rsp.status
                text = await rsp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            metrics.API_REQUESTS.labels(method, resource_of(path), "0").inc()
            raise ApiError(503, type(exc).__name__, str(exc) or "connection failed") from exc
        metrics.API_REQUESTS.labels(method, resource_of(path), str(status)).inc()
        try:
            data = json.loads(text) if text else None
        except ValueError:  # e.g. an HTML error page from a proxy or load balancer in front of the API
            if status < 400:
                raise ApiError(502, "BadResponse", f"HTTP {status} with a body that is not JSON: {text[:200]!r}") from None
            data = {"message": f"HTTP {status}: {text[:200]}"}
        if status == 401 and _retry:
            login()
            self.info = _credentials
            return await self.request(method, path, params=params, body=body, content_type=content_type,
                                      _retry=False)
        if status >= 400:
            data = data if isinstance(data, dict) else {}
            raise ApiError(status, data.get("reason") or "Error", data.get("message") or f"HTTP {status}")
        return data

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", resource_path(api_version, plural, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, plural: str, namespace: str | None, label_selector: str | None = None,
                   field_selector: str | None = None, not_older_than: int | None = None) -> list[dict[str, Any]]:
        """Items of a list call (selectors in the API's syntax: labels 'a=b,c=d', fields
        'metadata.name=x,type=Warning').

        not_older_than: None (default): a consistent read, which on etcd 3.4 or without
        ConsistentListFromCache reads and decodes every object of the namespace, so that one such list per
        reconcile pass costs O(objects) each and O(objects²) in all. An int: answered from the API server's
        watch cache and filtered in memory, at least as new as that resourceVersion
        (``resourceVersionMatch=NotOlderThan``; the server first lets its cache catch up) or, for 0, at any
        version (``resourceVersion=0``, an informer's first list). Pass ``seen(plural)``: with several API
        servers, one's cache may lag the watch the operator's event came from.

        Raises ApiError (504 when the cache does not reach the version within the server's wait)."""
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        if not_older_than == 0:
            params["resourceVersion"] = "0"
        elif not_older_than is not None:
            params.update(resourceVersion=str(not_older_than), resourceVersionMatch="NotOlderThan")
        data = await self.request("GET", resource_path(api_version, plural, namespace), params=params or None)
        return list((data or {}).get("items") or [])

    async def create(self, api_version: str, plural: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        """POST a new object; returns it as stored. Strict field validation: an unknown or duplicate
        field is a 422, not a warning and a silently dropped field."""
        return await self.request("POST", resource_path(api_version, plural, namespace), body=body,
                                  params=STRICT)

    async def patch(self, api_version: str, plural: str, namespace: str | None, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object or of its status/scale subresource (strict field
        validation, as ``create``)."""
        return await self.request("PATCH", resource_path(api_version, plural, namespace, name, subresource),
                                  body=patch, content_type="application/merge-patch+json", params=STRICT)

    async def server_version(self) -> str:
        """The API server's ``major.minor`` (GET /version, read once per client; e.g. "1.31", or "1.29+"
        from some managed clusters)."""
        if self._version is None:
            info = await self.request("GET", "/version") or {}
            self._version = f"{info.get('major', '')}.{info.get('minor', '')}"
        return self._version

    async def delete(self, api_version: str, plural: str, namespace: str | None, name: str) -> None:
        """DELETE the object (absent is fine)."""
        try:
            await self.request("DELETE", resource_path(api_version, plural, namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise
