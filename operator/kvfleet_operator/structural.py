"""Kubernetes' structural-schema rules for a CRD's openAPIV3Schema, checked offline.

An ``apiextensions.k8s.io/v1`` CustomResourceDefinition whose schema is not structural is refused by the
API server ("... must be empty to be structural"); kubernetes-validate, KMock and the CEL tests never see
it. ``problems(schema)`` applies the rules that need no API server, as the Kubernetes documentation
("Specifying a structural schema", Extend the Kubernetes API with CustomResourceDefinitions) and the
apiextensions validation state them:

1. a non-empty ``type`` at the root, for every property, every ``additionalProperties`` schema and every
   ``items`` schema, except in a node with ``x-kubernetes-int-or-string: true`` (which must have no
   ``type``) or ``x-kubernetes-preserve-unknown-fields: true``;
2. inside ``allOf``/``anyOf``/``oneOf``/``not`` only value validations (pattern, bounds, enum, required,
   ...): no ``type``, ``description``, ``default``, ``title``, ``nullable``, boolean
   ``additionalProperties`` or ``x-kubernetes-*`` extension; a property or ``items`` named there is also
   specified outside the junctor. The one exception is the int-or-string form, exactly
   ``anyOf: [{type: integer}, {type: string}]`` (optionally repeated in ``allOf`` entries) with
   ``x-kubernetes-int-or-string: true``; value validations such as ``pattern`` go beside that ``anyOf``;
3. ``metadata`` restricts at most ``name`` and ``generateName``;
4. v1 specifics: no ``$ref``, no ``additionalProperties: false``, no ``uniqueItems: true``, not both
   ``properties`` and ``additionalProperties``; keys of an ``x-kubernetes-list-type: map`` list are
   required or defaulted properties of its items.

Each problem is a line "PATH: what is wrong", PATH written as the API server writes it
(``properties[spec].properties[resources].anyOf[0].type``).
"""
from __future__ import annotations

from typing import Any

TYPES = ("object", "array", "string", "integer", "number", "boolean")
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]
#: what a schema inside a junctor may hold (apiextensions' ValueValidation and its nested restatements)
VALUE_VALIDATIONS = frozenset({
    "format", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern",
    "maxItems", "minItems", "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required",
    "properties", "items", "additionalProperties", *JUNCTORS})
METADATA_FIELDS = ("name", "generateName")


class StructuralSchemaError(ValueError):
    """The schema breaks the structural-schema rules; ``problems`` lists them ("PATH: what")."""

    def __init__(self, problems: list[str]):
        super().__init__("the CRD schema is not structural (the API server would refuse it):\n  "
                         + "\n  ".join(problems))
        self.problems = problems


def problems(schema: dict[str, Any]) -> list[str]:
    """Every structural-schema rule ``schema`` (an openAPIV3Schema) breaks; empty when it is structural."""
    out = _node(schema, "", need_type=True)
    meta = schema.get("properties", {}).get("metadata")
    if meta is not None:
        extra = sorted(set(meta) - {"type", "properties"}) + \
            sorted(f"properties[{k}]" for k in set(meta.get("properties", {})) - set(METADATA_FIELDS))
        out += [f"properties[metadata].{k}: Forbidden: must not be specified (only metadata.name and "
                f"metadata.generateName may be restricted)" for k in extra]
    return out


def check(schema: dict[str, Any]) -> None:
    """Raise StructuralSchemaError when ``problems(schema)`` finds any."""
    found = problems(schema)
    if found:
        raise StructuralSchemaError(found)


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _node(node: dict[str, Any], path: str, need_type: bool) -> list[str]:
    """Rules 1, 2 (junctors of this node), 4 for a schema node outside any junctor."""
    out: list[str] = []
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    open_fields = node.get("x-kubernetes-preserve-unknown-fields") is True
    kind = node.get("type")
    if int_or_string and kind is not None:
        out.append(f"{_join(path, 'type')}: Forbidden: must be empty for x-kubernetes-int-or-string")
    elif kind is None and need_type and not (int_or_string or open_fields):
        out.append(f"{_join(path, 'type')}: Required value: must not be empty for specified object fields")
    elif kind is not None and kind not in TYPES:
        out.append(f"{_join(path, 'type')}: Unsupported value: {kind!r}")
    out += _v1_rules(node, path)
    for junctor in JUNCTORS:
        if junctor in node:
            out += _junctor(node, junctor, path, int_or_string)
    for name, sub in node.get("properties", {}).items():
        out += _node(sub, _join(path, f"properties[{name}]"), need_type=True)
    if isinstance(node.get("additionalProperties"), dict):
        out += _node(node["additionalProperties"], _join(path, "additionalProperties"), need_type=True)
    if isinstance(node.get("items"), dict):
        out += _node(node["items"], _join(path, "items"), need_type=True)
    elif "items" in node:
        out.append(f"{_join(path, 'items')}: Forbidden: items must be a schema object, not a list")
    out += _list_map_keys(node, path)
    return out


def _v1_rules(node: dict[str, Any], path: str) -> list[str]:
    out = []
    if "$ref" in node:
        out.append(f"{_join(path, '$ref')}: Forbidden: $ref is not supported")
    if node.get("additionalProperties") is False:
        out.append(f"{_join(path, 'additionalProperties')}: Forbidden: additionalProperties cannot be set to false")
    if node.get("uniqueItems") is True:
        out.append(f"{_join(path, 'uniqueItems')}: Forbidden: uniqueItems cannot be set to true")
    if "properties" in node and "additionalProperties" in node:
        out.append(f"{_join(path, 'additionalProperties')}: Forbidden: additionalProperties and properties are "
                   f"mutual exclusive")
    return out


def _is_int_or_string_any_of(value: Any) -> bool:
    return value == INT_OR_STRING_ANY_OF


def _junctor(node: dict[str, Any], junctor: str, path: str, int_or_string: bool) -> list[str]:
    value = node[junctor]
    if junctor == "anyOf" and int_or_string and _is_int_or_string_any_of(value):
        return []  # the int-or-string form
    branches = [value] if junctor == "not" else value
    if not isinstance(branches, list):
        return [f"{_join(path, junctor)}: Invalid value: must be a list of schemas"]
    out: list[str] = []
    for i, branch in enumerate(branches):
        where = _join(path, junctor if junctor == "not" else f"{junctor}[{i}]")
        if junctor == "allOf" and int_or_string and _is_int_or_string_any_of(branch.get("anyOf")):
            branch = {k: v for k, v in branch.items() if k != "anyOf"}  # allOf: [{anyOf: int-or-string, ...}]
        out += _value_validation(branch, where, outside=node)
    return out


def _value_validation(node: dict[str, Any], path: str, outside: dict[str, Any]) -> list[str]:
    """Rule 2 inside a junctor: value validations only, each field and items also specified ``outside``."""
    out = [f"{_join(path, key)}: Forbidden: must be empty to be structural"
           for key in node if key not in VALUE_VALIDATIONS]
    if node.get("additionalProperties") is not None and not isinstance(node["additionalProperties"], dict):
        out.append(f"{_join(path, 'additionalProperties')}: Forbidden: must be empty to be structural")
    for name, sub in node.get("properties", {}).items():
        spec = outside.get("properties", {}).get(name)
        where = _join(path, f"properties[{name}]")
        if spec is None:
            out.append(f"{where}: Required value: must be specified outside of the junctor too")
        out += _value_validation(sub, where, outside=spec or {})
    if isinstance(node.get("items"), dict):
        if not isinstance(outside.get("items"), dict):
            out.append(f"{_join(path, 'items')}: Required value: must be specified outside of the junctor too")
        out += _value_validation(node["items"], _join(path, "items"), outside=outside.get("items") or {})
    if isinstance(node.get("additionalProperties"), dict):
        out += _value_validation(node["additionalProperties"], _join(path, "additionalProperties"),
                                 outside=outside.get("additionalProperties") or {})
    for junctor in JUNCTORS:
        if junctor in node:
            branches = [node[junctor]] if junctor == "not" else node[junctor]
            for i, branch in enumerate(branches):
                where = _join(path, junctor if junctor == "not" else f"{junctor}[{i}]")
                out += _value_validation(branch, where, outside=outside)
    return out


def _list_map_keys(node: dict[str, Any], path: str) -> list[str]:
    if node.get("x-kubernetes-list-type") != "map":
        return []
    items = node.get("items") or {}
    keys = node.get("x-kubernetes-list-map-keys") or []
    if not keys:
        return [f"{_join(path, 'x-kubernetes-list-map-keys')}: Required value: must not be empty if "
                f"x-kubernetes-list-type is map"]
    if items.get("type") != "object":
        return [f"{_join(path, 'items.type')}: Invalid value: must be object if x-kubernetes-list-type is map"]
    props, required = items.get("properties", {}), set(items.get("required", []))
    return [f"{_join(path, 'items')}: Required value: x-kubernetes-list-map-keys entry {key!r} must be a "
            f"required or defaulted property" for key in keys
            if key not in props or (key not in required and "default" not in props[key])]
