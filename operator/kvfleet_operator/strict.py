"""Strict validation of rendered children against the Kubernetes OpenAPI schema (pure).

The API server drops an unknown field of a built-in object with only a warning (without
``fieldValidation=Strict``), so a typo in a structure the spec passes through verbatim, such as
``scheduling.affinity.nodeAffinty``, would give pods that schedule anywhere while the
InferenceService looks healthy. ``check`` validates every rendered child with the strict JSON schemas
kubernetes-validate ships (the Kubernetes OpenAPI schema with ``additionalProperties: false``),
for the API server's version, and names each problem by the spec field it comes from:
``spec.scheduling.affinity.nodeAffinty: unknown field``.

``kubernetes_version`` picks the schema: the server's major.minor, clamped to
[``OLDEST``, the newest kubernetes-validate knows]; ``OLDEST`` is the oldest Kubernetes the chart
supports (Chart.yaml kubeVersion: the pods use the preStop ``sleep`` action of 1.30).
The schema of a (version, kind) is loaded once (about 1 MB of JSON per version).
"""
from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
import referencing
from kubernetes_validate import utils as kv
from packaging.version import Version

OLDEST = "1.30"
NEWEST = kv.major_minor(kv.latest_version())
_POD = ("spec", "template", "spec")
# rendered Deployment path -> the spec field it is rendered from ("*": any list index, kept in the name)
SPEC_FIELDS: tuple[tuple[tuple[Any, ...], str], ...] = (
    (_POD + ("affinity",), "spec.scheduling.affinity"),
    (_POD + ("tolerations",), "spec.scheduling.tolerations"),
    (_POD + ("nodeSelector",), "spec.scheduling.nodeSelector"),
    (_POD + ("topologySpreadConstraints",), "spec.scheduling.topologySpreadConstraints"),
    (_POD + ("priorityClassName",), "spec.scheduling.priorityClassName"),
    (_POD + ("runtimeClassName",), "spec.scheduling.runtimeClassName"),
    (_POD + ("imagePullSecrets",), "spec.imagePullSecrets"),
    (_POD + ("serviceAccountName",), "spec.serviceAccountName"),
    (_POD + ("containers", "*", "env"), "spec.engine.env"),  # the spec's env comes first in the rendered list
    (_POD + ("initContainers", "*", "env"), "spec.engine.env"),
    (_POD + ("containers", "*", "resources"), "spec.resources"),
    (_POD + ("containers", "*", "image"), "spec.engine.image"),
)


def kubernetes_version(server: str | None) -> str:
    """The schema version for an API server reporting ``server`` ("1.31", "v1.35.2", "1.29+"; None:
    unknown): its major.minor clamped to [OLDEST, NEWEST]."""
    m = re.match(r"^v?(\d+)\.(\d+)", server or "")
    if m is None:
        return NEWEST
    version = Version(f"{m.group(1)}.{m.group(2)}")
    return str(min(max(version, Version(OLDEST)), Version(NEWEST)))


@functools.lru_cache(maxsize=16)
def _validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema of ``kind`` for ``version`` (its file layout and loader,
    as ``kubernetes_validate.validate`` does, built once instead of per call)."""
    release = [v for v in kv.all_versions() if Version(kv.major_minor(v)) <= Version(version)][-1]
    folder = f"kubernetes-json-schema/v{release}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    definitions = kv.schema_contents(f"{folder}/_definitions.json", version)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def field_path(parts: Any) -> str:
    """A path as Kubernetes names fields: ``["spec", "tolerations", 0, "key"]`` -> ``spec.tolerations[0].key``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _spec_field(path: list[Any]) -> str | None:
    """The spec field a rendered Deployment path comes from, with the rest of the path appended."""
    for prefix, field in SPEC_FIELDS:
        if len(path) >= len(prefix) and all(p == "*" or p == q for p, q in zip(prefix, path)):
            rest = field_path(path[len(prefix):])
            return field + (rest if rest.startswith("[") or not rest else f".{rest}")
    return None


def problems(child: dict[str, Any], version: str) -> list[tuple[list[Any], str]]:
    """(path, message) for each way ``child`` breaks the strict schema of Kubernetes ``version``;
    an unknown field is reported at its own path with the message "unknown field"."""
    out: list[tuple[list[Any], str]] = []
    for err in _validator(version, child["apiVersion"], child["kind"]).iter_errors(child):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = err.schema.get("properties", {})
            out += [(path + [key], "unknown field") for key in sorted(err.instance) if key not in known]
        else:
            out.append((path, err.message))
    return sorted(out, key=lambda p: field_path(p[0]))


def check(children: list[dict[str, Any]], version: str) -> list[tuple[str | None, str]]:
    """Validate every child; returns (spec field or None, message) per problem, the message naming
    the spec field when the problem comes from one (``spec.scheduling.affinity.nodeAffinty: unknown
    field``), else the child's own path (``Deployment spec.template.spec.x: ...``). Empty: valid."""
    out: list[tuple[str | None, str]] = []
    for child in children:
        for path, message in problems(child, version):
            field = _spec_field(path) if child["kind"] == "Deployment" else None
            out.append((field, f"{field or child['kind'] + ' ' + field_path(path)}: {message}"))
    return out
