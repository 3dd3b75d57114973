"""Generate the InferenceService CRD from the pydantic models in ``api`` (like controller-gen).

``python -m kvfleet_operator.crdgen`` (``make manifests``) writes
crds/serving.kvfleet.dev_inferenceservices.yaml and the byte-identical chart copy
charts/kvfleet/crds/serving.kvfleet.dev_inferenceservices.yaml; ``--check`` only compares.

The conversion from pydantic's JSON schema to a Kubernetes *structural* schema: ``$ref`` inlined,
``Optional[X]`` becomes X (optional = not in ``required``), titles dropped, object defaults become
``{}`` so the API server defaults nested fields, and the CEL rules of ``api`` are attached as
``x-kubernetes-validations``. kopf keeps its state in annotations (see handlers.configure), so
no part of the status needs ``x-kubernetes-preserve-unknown-fields``.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from . import api

CRD_FILENAME = f"{api.GROUP}_{api.PLURAL}.yaml"
CRD_PATHS = (Path("crds") / CRD_FILENAME, Path("charts") / "kvfleet" / "crds" / CRD_FILENAME)
_DROP = {"title", "discriminator"}
_RULES_AT = {  # JSON path of the schema node -> CEL rules
    (): api.ROOT_RULES,
    ("spec",): api.SPEC_RULES,
    ("spec", "autoscaling"): api.AUTOSCALING_RULES,
    ("spec", "engine", "speculative"): api.SPECULATIVE_RULES,
    ("spec", "modelCache"): api.MODEL_CACHE_RULES,
}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Return a structural copy of one pydantic JSON-schema node (refs inlined, nulls dropped)."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    node = dict(node)
    if node.get("x-kubernetes-int-or-string"):
        pattern = node.pop("pattern", None)
        out = {k: v for k, v in node.items() if k in ("description", "default")}
        out["x-kubernetes-int-or-string"] = True
        out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
        if out.get("default") is None:
            out.pop("default", None)
        return out
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express union {branches} structurally")
        branch = _structural(branches[0], defs)
        keep = {k: v for k, v in node.items() if k not in _DROP}
        if keep.get("default", "absent") is None:
            keep.pop("default")
        return {**branch, **keep}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "properties":
            out["properties"] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _structural(value, defs)
        elif key == "additionalProperties":
            continue  # extra="forbid" is what pruning does anyway
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):  # JSON Schema 2020 -> OpenAPI 3.0 form
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = "integer" if kinds == {int} else "string"
    if out.get("type") == "object" and isinstance(out.get("default"), dict):
        out["default"] = {}
    if out.get("type") == "array" and out.get("default") == []:
        out.pop("default")  # omitted lists stay omitted (no drift in GitOps diffs)
    if out.get("default", "absent") is None:
        out.pop("default")
    if "x-kubernetes-preserve-unknown-fields" in out and "type" not in out:
        out["type"] = "object"
    return out


def _object_defaults(model: type[BaseModel], node: dict[str, Any]) -> None:
    """Give ``default: {}`` to nested objects whose pydantic field defaults to an empty model, so the API
    server defaults their fields when the user omits the whole object (as the models do)."""
    for name, field in model.model_fields.items():
        sub = node.get("properties", {}).get(field.alias or name)
        ann = field.annotation
        if sub is None or not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            continue
        if field.default_factory is ann:
            sub["default"] = {}
        _object_defaults(ann, sub)


def _attach_rules(schema: dict[str, Any]) -> None:
    for path, rules in _RULES_AT.items():
        node = schema
        for part in path:
            node = node["properties"][part]
        node["x-kubernetes-validations"] = copy.deepcopy(rules)


def _ordered(node: Any) -> Any:
    """Sort every ``properties`` mapping by name so the output bytes are stable and easy to read."""
    if isinstance(node, dict):
        return {k: ({pk: _ordered(pv) for pk, pv in sorted(v.items())} if k == "properties" else _ordered(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_ordered(v) for v in node]
    return node


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the InferenceService CRD (a structural schema)."""
    spec_js = api.InferenceServiceSpec.model_json_schema(by_alias=True, mode="validation")
    status_js = api.InferenceServiceStatus.model_json_schema(by_alias=True, mode="serialization")
    spec = _structural(spec_js, spec_js.get("$defs", {}))
    _object_defaults(api.InferenceServiceSpec, spec)
    status = _structural(status_js, status_js.get("$defs", {}))
    status.pop("required", None)
    schema = {
        "type": "object",
        "description": "InferenceService serves one model behind an OpenAI-compatible Service: the operator "
                       "renders a Deployment of kvfleet-server pods, a Service and a PodDisruptionBudget.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    _attach_rules(schema)
    return _ordered(schema)


PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".status.model", "description": "Served model name."},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.engine.tensorParallelSize",
     "description": "Tensor parallel size."},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Pods."},
    {"name": "Ready", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status",
     "description": "Ready condition."},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "description": "OpenAI base URL in the cluster."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}",
                     "labels": {"app.kubernetes.io/part-of": "kvfleet"}},
        "spec": {
            "group": api.GROUP,
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.SINGULAR, "shortNames": list(api.SHORT_NAMES), "categories": ["kvfleet"]},
            "scope": "Namespaced",
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML text committed in crds/ (stable bytes)."""
    header = "# Generated by `python -m kvfleet_operator.crdgen` (make manifests) from kvfleet_operator/api.py.\n" \
             "# Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_operator.crdgen", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="repository root (default: current directory)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from the generated CRD")
    args = parser.parse_args(argv)
    text = crd_yaml()
    stale = []
    for rel in CRD_PATHS:
        path = Path(args.root) / rel
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(str(rel))
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if args.check and stale:
        print("out of date (run `make manifests`): " + ", ".join(stale), file=sys.stderr)
        return 1
    for rel in stale:
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
