"""50 JSON schemas for the structured-output tests and benchmark (imported as a plain module).

Each mixes nested objects, arrays, enums, required fields, string patterns and bounded numbers, and is
designed to finish within a short max_tokens: every string has a maxLength or a bounded pattern, every
array a maxItems, every number bounds (so a temperature-1 sample cannot run on until max_tokens).
"""

from __future__ import annotations

COLORS = ["red", "green", "blue", "black", "white"]
NAMES = ["name", "title", "city", "label", "code", "brand", "owner", "topic", "animal", "fruit"]


def _string(i: int) -> dict:
    k = i % 4
    if k == 0:
        return {"type": "string", "maxLength": 12}
    if k == 1:
        return {"type": "string", "pattern": "^[A-Z]{2,3}-[0-9]{2}$"}
    if k == 2:
        return {"type": "string", "enum": COLORS[: 2 + i % 4]}
    return {"type": "string", "minLength": 1, "maxLength": 8}


def _number(i: int) -> dict:
    if i % 3 == 0:
        return {"type": "integer", "minimum": 0, "maximum": 100 + i}
    if i % 3 == 1:
        return {"type": "integer", "minimum": -50, "maximum": 50}
    return {"type": "number", "minimum": 0, "maximum": 10}


def make_schemas(count: int = 50) -> list[tuple[str, dict]]:
    """``count`` (prompt, schema) pairs, deterministic."""
    out = []
    for i in range(count):
        a, b = NAMES[i % len(NAMES)], NAMES[(i + 3) % len(NAMES)]
        props = {a: _string(i), "count": _number(i)}
        required = [a, "count"]
        if i % 2 == 0:
            props["tags"] = {"type": "array", "items": _string(i + 1), "minItems": 1, "maxItems": 2 + i % 2}
            required.append("tags")
        if i % 3 == 0:
            props["details"] = {"type": "object", "properties": {b: _string(i + 2), "score": _number(i + 1)},
                                "required": [b, "score"], "additionalProperties": False}
            required.append("details")
        if i % 5 == 0:
            props["active"] = {"type": "boolean"}
            required.append("active")
        if i % 7 == 0:
            props["items"] = {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                 "color": {"type": "string", "enum": COLORS}},
                "required": ["id", "color"], "additionalProperties": False}}
            required.append("items")
        if i % 4 == 3:
            props["note"] = {"type": "string", "maxLength": 10}  # optional
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        prompt = f"Describe a {a} and its {b} as a JSON object with the fields {', '.join(props)}."
        out.append((prompt, schema))
    return out
