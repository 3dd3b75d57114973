"""Carrying out one planned write to an owned child (``apply.plan``'s action): the one place that
creates, patches or deletes children — the Deployment/Service/PDB of a reconcile (``handlers``), the
routing objects (``routing_sync``), the model cache's claim and Jobs (``weights``) — counts it and turns
the API server's 422 into ``render.Unrealisable("ChildInvalid")``."""
from __future__ import annotations

import logging
from typing import Any

from . import kube, metrics, render


async def write(client: kube.KubeClient, logger: logging.Logger | logging.LoggerAdapter, action: str,
                body: dict[str, Any] | None, have: dict[str, Any] | None, api_version: str, plural: str,
                namespace: str, name: str, kind: str, label: str | None = None,
                invalid_field: str | None = None) -> dict[str, Any] | None:
    """Do ``action`` (create, patch, delete, noop) for child ``namespace/name``; returns the object the
    server answered (``have`` for noop, None for delete).

    kind: the child's kind, for logs; label: its ``kind`` label on the ``kvfleet_operator_child_writes``
    counter (default: kind). invalid_field: the spec field a 422 names, if one does. Raises render.Unrealisable(ChildInvalid) on 422 (retrying
    cannot help: the spec must change) and kube.ApiError otherwise."""
    try:
        if action == "create":
            logger.info(f"Creating {kind} {namespace}/{name}")
            result = await client.create(api_version, plural, namespace, body)
        elif action == "patch":
            logger.info(f"Patching {kind} {namespace}/{name}: {sorted(body or {})}")
            result = await client.patch(api_version, plural, namespace, name, body)
        elif action == "delete":
            logger.info(f"Deleting {kind} {namespace}/{name} (no longer wanted)")
            await client.delete(api_version, plural, namespace, name)
            result = None
        else:
            return have
    except kube.ApiError as exc:
        if exc.status == 422:
            where = f"{invalid_field}: " if invalid_field else ""
            raise render.Unrealisable("ChildInvalid", f"{where}the API server refused the {kind}: "
                                                      f"{exc.message}") from None
        raise
    metrics.CHILD_WRITES.labels(kind=label or kind, action=action).inc()
    return result
