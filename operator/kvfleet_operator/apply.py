"""Pure apply planning: create, or a three-way JSON merge patch, or nothing.

The apply method (docs/operator.md): children are created with POST, then kept in line with a JSON
merge patch (RFC 7386) computed like ``kubectl apply``'s client-side three-way merge: a field is
written when the live value does not already contain the desired one; a field the operator set
before (recorded in the ``serving.kvfleet.dev/last-applied`` annotation) and no longer renders is
removed; fields written by others (API-server defaults, ``kubectl rollout restart`` annotations,
the autoscaler's replicas) are left alone. A live object that already contains the desired state
gets no request at all, so a second reconcile pass writes nothing.
"""
from __future__ import annotations

import copy
import json
import re
from decimal import Decimal
from typing import Any

LAST_APPLIED = "serving.kvfleet.dev/last-applied"
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]i?|Ki)?$")
_SUFFIX = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
           "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity (4, "500m", "16Gi", "1e3") as a Decimal; None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    m = _QUANTITY.match(str(value))
    if not m:
        return None
    try:
        number, suffix = Decimal(m.group(1)), m.group(2) or ""
        if suffix[:1] in ("e", "E"):
            return number * (Decimal(10) ** int(suffix[1:]))
        return number * Decimal(_SUFFIX[suffix])
    except (ArithmeticError, KeyError, ValueError):
        return None


def contains(live: Any, desired: Any) -> bool:
    """Whether ``live`` already holds ``desired``: dict keys recursively (extra live keys allowed),
    lists element-wise with equal length, quantities by value ("1000m" == "1")."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    if live == desired and type(live) is type(desired):
        return True
    if isinstance(desired, str) and isinstance(live, str):
        a, b = quantity(live), quantity(desired)
        return a is not None and a == b
    return False


def three_way_patch(last: dict[str, Any] | None, desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch turning ``live`` into one containing ``desired``, removing keys of ``last``
    that ``desired`` dropped. Empty when nothing needs writing."""
    last = last if isinstance(last, dict) else {}
    out: dict[str, Any] = {}
    for key, want in desired.items():
        have = live.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            sub = three_way_patch(last.get(key), want, have)
            if sub:
                out[key] = sub
        elif not contains(have, want):
            out[key] = copy.deepcopy(want)
    for key in last:
        if key not in desired and key in live:
            out[key] = None
    return out


def applied_record(desired: dict[str, Any]) -> str:
    """What the last-applied annotation stores: the rendered labels, annotations and spec, without
    spec.replicas (which the autoscaler may own), as compact sorted JSON."""
    meta = desired.get("metadata", {})
    record: dict[str, Any] = {"metadata": {k: meta[k] for k in ("labels", "annotations") if k in meta}}
    spec = {k: v for k, v in (desired.get("spec") or {}).items() if k != "replicas"}
    record["spec"] = spec
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def with_record(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` with the last-applied annotation added (the body to create)."""
    body = copy.deepcopy(desired)
    body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied_record(desired)
    return body


def plan(desired: dict[str, Any], live: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """("create", body) when absent, ("patch", merge_patch) when it differs, ("noop", None) otherwise."""
    if live is None:
        return "create", with_record(desired)
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    try:
        last = json.loads(annotations.get(LAST_APPLIED) or "{}")
    except ValueError:
        last = {}
    patch = three_way_patch(last, desired, live)
    record = applied_record(desired)
    if not patch and annotations.get(LAST_APPLIED) == record:
        return "noop", None
    patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = record
    return "patch", patch


def controlled_by(obj: dict[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` has a controller ownerReference to ``uid`` (no uid: any InferenceService)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "InferenceService" and (uid is None or ref.get("uid") == uid):
            return True
    return False


def adoptable(obj: dict[str, Any], owner_label: str, name: str) -> bool:
    """An orphan left by `kubectl delete --cascade=orphan` of an InferenceService of the same name:
    labelled ``owner_label: name`` and without any controller. Applying it then sets our ownerReference."""
    meta = obj.get("metadata") or {}
    has_controller = any(ref.get("controller") for ref in meta.get("ownerReferences") or [])
    return not has_controller and (meta.get("labels") or {}).get(owner_label) == name
