"""Structured-output request fields → one ``StructuredOutputsParams`` (pure), and its compile with a timeout.

Fields (OpenAI's and vLLM's), on both /v1/completions and /v1/chat/completions:

- ``response_format``: ``{"type": "text"}`` (no constraint) | ``{"type": "json_object"}`` |
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` (vLLM);
- ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``: vLLM's older names.

At most one source may be set (two → 400 naming both); a JSON schema must itself be valid JSON Schema
(checked with ``jsonschema``'s meta-schema, 400 naming the field). Tools build their own spec
(api/tools.py); a request cannot combine a tool grammar with one of these fields.
"""

from __future__ import annotations

import asyncio
import json

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
DEFAULT_COMPILE_TIMEOUT = 5.0


def check_json_schema(schema, param: str) -> dict:
    """The schema as a dict; InvalidRequestError naming ``param`` if it is not valid JSON Schema."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    if isinstance(schema, bool):
        raise InvalidRequestError(f"{param} must be a JSON Schema object, got a boolean schema", param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.absolute_path)
        raise InvalidRequestError(f"{param} is not a valid JSON Schema: {exc.message}"
                                  + (f" (at {where})" if where else ""), param=param) from None
    except Exception as exc:  # noqa: BLE001 - e.g. a non-string $schema, a schema nested too deep
        raise InvalidRequestError(f"{param} is not a valid JSON Schema: {type(exc).__name__}", param=param) from None
    return schema


def _set(value) -> bool:
    return value is not None and value is not False and value != "" and value != [] and value != {}


def _from_response_format(rf) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise InvalidRequestError("response_format must be an object with a 'type'", param="response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidRequestError("response_format.json_schema.schema is required for type json_schema",
                                      param="response_format.json_schema")
        name = js.get("name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
            raise InvalidRequestError("response_format.json_schema.name must be a string of 1 to 64 characters",
                                      param="response_format.json_schema.name")
        return StructuredOutputsParams(json=check_json_schema(js["schema"], "response_format.json_schema.schema"))
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format.type")


def _from_structured_outputs(so) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    extra = sorted(k for k, v in so.items() if k not in SO_KEYS and _set(v))
    if extra:
        raise InvalidRequestError(f"not supported: structured_outputs.{extra[0]} (supported: {', '.join(SO_KEYS)})",
                                  param=f"structured_outputs.{extra[0]}")
    given = [k for k in SO_KEYS if _set(so.get(k))]
    if len(given) != 1:
        raise InvalidRequestError(f"structured_outputs must set exactly one of {', '.join(SO_KEYS)}; got "
                                  f"{', '.join(given) or 'none'}", param="structured_outputs")
    k = given[0]
    value = so[k]
    if k == "json":
        value = check_json_schema(value, "structured_outputs.json")
    spec = StructuredOutputsParams(**{k: True if k == "json_object" else value})
    spec.validate()
    return spec


def structured_from_request(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """(spec, the field it came from) for a Completion or ChatCompletion request; (None, None) if unconstrained.

    Raises:
        InvalidRequestError: conflicting fields (param names the second one), an invalid spec or schema.
    """
    sources = []
    rf = getattr(req, "response_format", None)
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        sources.append("response_format")
    if _set(getattr(req, "structured_outputs", None)):
        sources.append("structured_outputs")
    sources += [f for f in GUIDED_FIELDS if _set(getattr(req, f, None))]
    if len(sources) > 1:
        raise InvalidRequestError(f"conflicting structured-output fields: {sources[0]} and {sources[1]}; set one",
                                  param=sources[1])
    if not sources:
        return None, None
    src = sources[0]
    if src == "response_format":
        return _from_response_format(rf), "response_format"
    if src == "structured_outputs":
        spec = _from_structured_outputs(req.structured_outputs)
        return spec, f"structured_outputs.{spec.kind}"
    kind = GUIDED_FIELDS[src]
    value = getattr(req, src)
    if kind == "json":
        value = check_json_schema(value, src)
    spec = StructuredOutputsParams(**{kind: value})
    spec.validate(src)
    return spec, src


async def compile_spec(llm, spec: StructuredOutputsParams, param: str, metrics=None) -> None:
    """Compile ``spec`` on the engine's grammar pool (never on the engine thread) within the configured timeout.

    Raises:
        InvalidRequestError: the engine has no grammar support, the spec is refused, or the compile
            exceeded ``structured_outputs_config.compile_timeout`` seconds (the engine is not blocked:
            the compile finishes, or not, in its pool thread; its result is cached for a retry).
    """
    if not hasattr(type(llm), "grammar_compiler"):  # on the class: the property builds the compiler
        raise InvalidRequestError(f"{param}: this engine has no structured-output support", param=param)
    cfg = getattr(llm, "config", None)
    timeout = (cfg.resolved_structured_outputs()["compile_timeout"] if cfg is not None
               else DEFAULT_COMPILE_TIMEOUT)
    from ..sample.grammar import UnsupportedGrammarFeature

    try:
        compiler = await asyncio.to_thread(lambda: llm.grammar_compiler)  # built on first use (~0.5 s)
        _, seconds = await asyncio.wait_for(asyncio.wrap_future(compiler.submit(spec, param)), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        if metrics is not None:
            metrics.structured_output_rejected("compile_timeout")
        raise InvalidRequestError(f"{param}: compiling the grammar took longer than {timeout:g} s "
                                  "(structured_outputs_config.compile_timeout); simplify the schema",
                                  param=param) from None
    except UnsupportedGrammarFeature:
        if metrics is not None:
            metrics.structured_output_rejected("unsupported_feature")
        raise
    except InvalidRequestError:
        if metrics is not None:
            metrics.structured_output_rejected("invalid")
        raise
    if metrics is not None:
        metrics.structured_output_compiled(spec.kind, seconds)
