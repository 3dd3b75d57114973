"""Custom resources the operator renders, checked against the published CRD schemas stored here.

``schemas/*-v1.json`` hold the openAPIV3Schema of the InferencePool (Gateway API Inference Extension
v1.6.0) and HTTPRoute (Gateway API v1.6.1, standard channel) CRDs, copied verbatim
(``schemas/extract_openapi.py``). ``validate`` checks an object the way the API server does with
``kubectl --validate=strict``: unknown fields are errors (structural pruning would drop them), then
defaults, the OpenAPI schema and every CEL rule (``kvfleet_operator.admission``: jsonschema + cel-python).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfleet_operator import admission

SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): SCHEMAS / "inferencepool-inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): SCHEMAS / "httproute-gateway.networking.k8s.io-v1.json",
}


def schema(api_version: str, kind: str) -> dict[str, Any]:
    return json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())["openAPIV3Schema"]


def unknown_fields(obj: Any, pruned: Any, where: str = "") -> list[str]:
    """Paths present in ``obj`` but dropped by structural pruning (``pruned``)."""
    out: list[str] = []
    if isinstance(obj, dict) and isinstance(pruned, dict):
        for key, value in obj.items():
            path = f"{where}.{key}" if where else key
            out += [path] if key not in pruned else unknown_fields(value, pruned[key], path)
    elif isinstance(obj, list) and isinstance(pruned, list):
        for i, (a, b) in enumerate(zip(obj, pruned)):
            out += unknown_fields(a, b, f"{where}[{i}]")
    return out


def validate(obj: dict[str, Any]) -> list[str]:
    """Error messages naming fields (empty: the API server would store ``obj``)."""
    node = schema(obj["apiVersion"], obj["kind"])
    errors = [f"{path}: unknown field" for path in unknown_fields(obj, admission.prune(obj, node))]
    return errors + admission.validate(obj, node)
