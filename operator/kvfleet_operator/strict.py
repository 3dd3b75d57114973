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
A version's schemas are loaded once (its definitions take about 2.5 MB in memory).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from collections import OrderedDict
from typing import Any

import jsonschema
import referencing
from kubernetes_validate import utils as kv
from packaging.version import Version

OLDEST = "1.30"
NEWEST = kv.major_minor(kv.latest_version())
MEMO_SIZE = 1024
_memo: OrderedDict[bytes, tuple[tuple[str | None, str], ...]] = OrderedDict()
_POD = ("spec", "template", "spec")
# rendered Deployment path -> the spec field passed through verbatim to it. The other spec fields are
# typed by the spec's models (unknown fields, enums and quantities refused at parse), so a schema
# problem anywhere else is a rendering defect, named by the child's own path.
SPEC_FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (_POD + ("affinity",), "spec.scheduling.affinity"),
    (_POD + ("topologySpreadConstraints",), "spec.scheduling.topologySpreadConstraints"),
)


def kubernetes_version(server: str | None) -> str:
    """The schema version for an API server reporting ``server`` ("1.31", "v1.35.2", "1.29+"; None:
    unknown): its major.minor clamped to [OLDEST, NEWEST]."""
    m = re.match(r"^v?(\d+)\.(\d+)", server or "")
    if m is None:
        return NEWEST
    version = Version(f"{m.group(1)}.{m.group(2)}")
    return str(min(max(version, Version(OLDEST)), Version(NEWEST)))


def _folder(version: str) -> str:
    """kubernetes-validate's strict schemas of the newest release not newer than ``version``."""
    release = [v for v in kv.all_versions() if Version(kv.major_minor(v)) <= Version(version)][-1]
    return f"kubernetes-json-schema/v{release}-local-strict"


@functools.lru_cache(maxsize=4)
def _definitions_json(version: str) -> dict[str, Any]:
    """The shared definitions of ``version``, parsed once (about 2.5 MB in memory)."""
    return kv.schema_contents(f"{_folder(version)}/_definitions.json", version)


@functools.lru_cache(maxsize=4)
def _definitions(version: str) -> referencing.Registry:
    """The shared definitions as a registry (holding ``_definitions_json``'s object, not a copy)."""
    return referencing.Resource.from_contents(_definitions_json(version)) @ referencing.Registry()


@functools.lru_cache(maxsize=16)
def _validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema of ``kind`` for ``version`` (its file layout and loader,
    as ``kubernetes_validate.validate`` does, built once instead of per call)."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv.schema_contents(f"{_folder(version)}/{kind.lower()}-{group}.json", version)
    registry = referencing.Resource.from_contents(schema) @ _definitions(version)
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
        if tuple(path[:len(prefix)]) == prefix:
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


# the i-th ``instance`` string of ``check`` is validated as this: "<" and ">" are in no Kubernetes name,
# uid or label, so it is not part of one, and mapping it back in a message cannot form another
PLACEHOLDER = "<instance-{}>"


@functools.lru_cache(maxsize=4)
def _enum_values(version: str) -> frozenset[str]:
    """Every string an enum of the ``version`` schemas allows: a value that is one of them may change a
    child's validity when it is replaced, so it is never replaced."""
    out: set[str] = set()
    stack: list[Any] = [_definitions_json(version)]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("enum"), list):
                out.update(v for v in x["enum"] if isinstance(v, str))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return frozenset(out)


def _replaced(x: Any, values: dict[str, str]) -> Any:
    """``x`` with every string value (not key) that is a key of ``values`` replaced by its value."""
    if isinstance(x, dict):
        return {k: _replaced(v, values) for k, v in x.items()}
    if isinstance(x, list):
        return [_replaced(v, values) for v in x]
    return values[x] if isinstance(x, str) and x in values else x


def check(children: list[dict[str, Any]], version: str, instance: tuple[str, ...] = ()) -> list[tuple[str | None, str]]:
    """Validate every child; returns (spec field or None, message) per problem, the message naming
    the spec field when the problem comes from one (``spec.scheduling.affinity.nodeAffinty: unknown
    field``), else the child's own path (``Deployment spec.template.spec.x: ...``). Empty: valid.

    Validating a Deployment takes about 6 ms of CPU, and a reconcile renders the same children again
    on every event of theirs; so results are remembered by a SHA-256 digest of (version, children)
    for the last ``MEMO_SIZE`` distinct renderings (32-byte keys, no object content kept).
    ``instance``: the strings that differ between otherwise identical InferenceServices (their name
    and uid). String values equal to one of them are validated as a placeholder (PLACEHOLDER), so
    1,000 services of one shape cost one validation: the schemas constrain such values only by enums
    (formats are not asserted), and a value an enum allows is never replaced. Messages name the
    instance's own strings."""
    enums = _enum_values(version)
    values = {v: PLACEHOLDER.format(i) for i, v in enumerate(instance) if v and v not in enums}
    if values:
        children = _replaced(children, values)
    key = hashlib.sha256(json.dumps([version, children], sort_keys=True, separators=(",", ":")).encode()).digest()
    if key not in _memo:
        out: list[tuple[str | None, str]] = []
        for child in children:
            for path, message in problems(child, version):
                field = _spec_field(path) if child["kind"] == "Deployment" else None
                out.append((field, f"{field or child['kind'] + ' ' + field_path(path)}: {message}"))
        _memo[key] = tuple(out)
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    _memo.move_to_end(key)
    found = list(_memo[key])
    for value, placeholder in values.items():
        found = [(field, value.join(message.split(placeholder))) for field, message in found]
    return found
