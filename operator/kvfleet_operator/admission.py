"""What the API server does to a custom resource before storing it, for checks outside a cluster.

Given the CRD's structural schema: ``apply_defaults`` (schema defaults, recursively, as the API
server's defaulting does), ``prune`` (drops fields the schema does not declare, as structural
pruning does; ``x-kubernetes-preserve-unknown-fields`` subtrees are kept), and ``validate``
(OpenAPI v3 validation with jsonschema's Draft 4 semantics, which match OpenAPI 3.0's boolean
exclusiveMinimum, unique keys of ``x-kubernetes-list-type: map`` lists, then every
``x-kubernetes-validations`` CEL rule evaluated with cel-python).
Used by ``kvfleet-operator render`` and by the tests; jsonschema and cel-python are imported lazily.
"""
from __future__ import annotations

import copy
from typing import Any

from . import crdgen
from .strict import field_path


def schema() -> dict[str, Any]:
    """The generated openAPIV3Schema of InferenceService."""
    return crdgen.openapi_schema()


def apply_defaults(obj: Any, node: dict[str, Any]) -> Any:
    """Return a copy of ``obj`` with the schema's defaults filled in (objects, recursively)."""
    obj = copy.deepcopy(obj)
    _default(obj, node)
    return obj


def _default(obj: Any, node: dict[str, Any]) -> None:
    if isinstance(obj, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default(obj[name], sub)
    elif isinstance(obj, list) and "items" in node:
        for item in obj:
            _default(item, node["items"])


def prune(obj: Any, node: dict[str, Any]) -> Any:
    """Return a copy of ``obj`` without the fields a structural schema would prune.

    An object node without properties (``metadata``) is kept whole: the API server handles
    ObjectMeta itself."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in node:
        return {k: prune(v, node["properties"][k]) for k, v in obj.items() if k in node["properties"]}
    if isinstance(obj, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: prune(v, node["additionalProperties"]) for k, v in obj.items()}
    if isinstance(obj, list) and "items" in node:
        return [prune(v, node["items"]) for v in obj]
    return copy.deepcopy(obj)


def validate(obj: dict[str, Any], node: dict[str, Any] | None = None) -> list[str]:
    """Validate like the API server: defaults, schema, then CEL. Returns messages naming fields (empty: valid)."""
    import jsonschema

    node = schema() if node is None else node
    if not (obj.get("metadata") or {}).get("name"):
        return ["metadata.name: Required value: name is required"]  # checked before the schema, as the API server does
    obj = apply_defaults(obj, node)
    errors = [f"{field_path(e.absolute_path) or '<root>'}: {e.message}"
              for e in sorted(jsonschema.Draft4Validator(_strip_k8s(node)).iter_errors(obj), key=str)]
    errors += _list_map_keys(obj, node, [])
    if not errors:
        errors += _cel(obj, node, [])
    return errors


def _list_map_keys(obj: Any, node: dict[str, Any], where: list[Any]) -> list[str]:
    """``x-kubernetes-list-type: map`` lists: the API server refuses two items with the same keys."""
    errors: list[str] = []
    if isinstance(obj, list) and node.get("x-kubernetes-list-type") == "map":
        keys = node.get("x-kubernetes-list-map-keys", [])
        seen: set[tuple[Any, ...]] = set()
        for i, item in enumerate(obj):
            key = tuple((item or {}).get(k) for k in keys) if isinstance(item, dict) else (item,)
            if key in seen:
                errors.append(f"{field_path(where + [i])}: Duplicate value: {dict(zip(keys, key))}")
            seen.add(key)
    if isinstance(obj, dict):
        for name, sub in node.get("properties", {}).items():
            if name in obj:
                errors += _list_map_keys(obj[name], sub, where + [name])
    elif isinstance(obj, list) and "items" in node:
        for i, item in enumerate(obj):
            errors += _list_map_keys(item, node["items"], where + [i])
    return errors


def _strip_k8s(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_k8s(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip_k8s(v) for v in node]
    return node


def _cel(obj: Any, node: dict[str, Any], where: list[Any]) -> list[str]:
    import celpy

    errors: list[str] = []
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations", []):
        value = obj
        if not where:  # root rules see only metadata.name/generateName
            value = {**obj, "metadata": {k: v for k, v in obj.get("metadata", {}).items()
                                         if k in ("name", "generateName")}}
        try:
            result = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as exc:  # e.g. a field the rule reads is absent: the rule fails
            result = exc
        if isinstance(result, Exception) or not bool(result):
            field = field_path(where) + rule.get("fieldPath", "") or ("metadata.name" if "metadata.name" in rule["rule"]
                                                                 else "<root>")
            errors.append(f"{field.lstrip('.')}: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for name, sub in node.get("properties", {}).items():
            if name in obj:
                errors += _cel(obj[name], sub, where + [name])
    elif isinstance(obj, list) and "items" in node:
        for i, item in enumerate(obj):
            errors += _cel(item, node["items"], where + [i])
    return errors
