"""crdgen's offline structural-schema check: it refuses what a real kube-apiserver refuses as "not structural"
(issue 34: the int-or-string fields carried `type`/`pattern` inside `anyOf`, and the CRD could not be installed),
and the generated CRD passes it."""
from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

import yaml

from kvfleet_operator import crdgen, structural

ROOT = Path(__file__).resolve().parents[2]
QUANTITY = {"description": "a quantity", "pattern": "^[0-9]+$", "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}]}


def _root(**props) -> dict:
    return {"type": "object", "properties": {"spec": {"type": "object", "properties": props}}}


def test_the_generated_crds_are_structural():
    paths = [d / name for d in (ROOT / "crds", ROOT / "charts" / "kvfleet" / "crds")
             for name in (crdgen.CRD_FILENAME, crdgen.PEERING_FILENAME)]
    for path in paths:
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                assert structural.problems(version["schema"]["openAPIV3Schema"]) == [], path


def test_quantities_use_the_exact_int_or_string_form_with_the_pattern_beside_it():
    spec = crdgen.openapi_schema()["properties"]["spec"]["properties"]
    for node in (spec["resources"]["properties"]["cpu"], spec["resources"]["properties"]["memory"],
                 spec["modelCache"]["properties"]["emptyDir"]["properties"]["sizeLimit"]):
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}]
        assert node["x-kubernetes-int-or-string"] is True and "type" not in node
        assert node["pattern"].startswith("^")


def test_the_form_the_api_server_refused_is_refused():
    # issue 34's CRD, as the API server answered: "...anyOf[0].type: Forbidden: must be empty to be structural"
    old = {**QUANTITY, "anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[0-9]+$"}]}
    del old["pattern"]
    assert structural.problems(_root(sizeLimit=old)) == [
        "properties[spec].properties[sizeLimit].anyOf[0].type: Forbidden: must be empty to be structural",
        "properties[spec].properties[sizeLimit].anyOf[1].type: Forbidden: must be empty to be structural"]
    assert structural.problems(_root(sizeLimit=QUANTITY)) == []
    # the allOf repetition of the int-or-string anyOf is the other allowed form
    assert structural.problems(_root(q={**QUANTITY, "allOf": [{"anyOf": QUANTITY["anyOf"], "maxLength": 9}]})) == []


def test_junctors_hold_value_validations_only():
    bad = {"type": "object", "properties": {"a": {"type": "string"}},
           "anyOf": [{"required": ["a"], "description": "no", "default": {}},
                     {"properties": {"a": {"nullable": True, "minLength": 1}, "b": {"maxLength": 3}}}],
           "not": {"x-kubernetes-preserve-unknown-fields": True},
           "allOf": [{"additionalProperties": False}]}
    assert structural.problems(_root(o=bad)) == [
        "properties[spec].properties[o].allOf[0].additionalProperties: Forbidden: must be empty to be structural",
        "properties[spec].properties[o].anyOf[0].description: Forbidden: must be empty to be structural",
        "properties[spec].properties[o].anyOf[0].default: Forbidden: must be empty to be structural",
        "properties[spec].properties[o].anyOf[1].properties[a].nullable: Forbidden: must be empty to be structural",
        "properties[spec].properties[o].anyOf[1].properties[b]: Required value: must be specified outside of the "
        "junctor too",
        "properties[spec].properties[o].not.x-kubernetes-preserve-unknown-fields: Forbidden: must be empty to be "
        "structural"]
    # the same constraints as value validations only are structural
    good = {"type": "object", "properties": {"a": {"type": "string"}},
            "anyOf": [{"required": ["a"]}, {"properties": {"a": {"minLength": 1}}}], "not": {"required": ["b"]}}
    assert structural.problems(_root(o=good)) == []


def test_every_field_has_a_type_unless_int_or_string_or_open():
    schema = _root(n={"description": "untyped"}, q=QUANTITY, free={"x-kubernetes-preserve-unknown-fields": True},
                   l={"type": "array", "items": {"properties": {}}},
                   m={"type": "object", "additionalProperties": {"description": "x"}},
                   both={**QUANTITY, "type": "string"}, weird={"type": "map"})
    assert structural.problems(schema) == [
        "properties[spec].properties[n].type: Required value: must not be empty for specified object fields",
        "properties[spec].properties[l].items.type: Required value: must not be empty for specified object fields",
        "properties[spec].properties[m].additionalProperties.type: Required value: must not be empty for specified "
        "object fields",
        "properties[spec].properties[both].type: Forbidden: must be empty for x-kubernetes-int-or-string",
        "properties[spec].properties[weird].type: Unsupported value: 'map'"]


def test_v1_rules_metadata_and_list_map_keys():
    schema = _root(r={"$ref": "#/x", "type": "object"}, f={"type": "object", "additionalProperties": False},
                   u={"type": "array", "uniqueItems": True, "items": {"type": "string"}},
                   env={"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object", "properties": {"name": {"type": "string"}}}})
    schema["properties"]["metadata"] = {"type": "object", "properties": {"name": {"type": "string"},
                                                                         "labels": {"type": "object"}}}
    assert structural.problems(schema) == [
        "properties[spec].properties[r].$ref: Forbidden: $ref is not supported",
        "properties[spec].properties[f].additionalProperties: Forbidden: additionalProperties cannot be set to false",
        "properties[spec].properties[u].uniqueItems: Forbidden: uniqueItems cannot be set to true",
        "properties[spec].properties[env].items: Required value: x-kubernetes-list-map-keys entry 'name' must be a "
        "required or defaulted property",
        "properties[metadata].properties[labels]: Forbidden: must not be specified (only metadata.name and "
        "metadata.generateName may be restricted)"]


def test_crdgen_fails_on_a_schema_the_api_server_would_refuse(monkeypatch, tmp_path):
    def old_form(node):  # the int-or-string conversion as it was before issue 34
        out = {k: v for k, v in node.items() if k == "description"}
        return {**out, "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string", "pattern": node["pattern"]}]}

    monkeypatch.setattr(crdgen, "_int_or_string", old_form)
    err = io.StringIO()
    with redirect_stderr(err):
        assert crdgen.main(["--root", str(tmp_path)]) == 1
    assert not (tmp_path / "crds").exists()  # nothing written
    assert ("properties[spec].properties[resources].properties[cpu].anyOf[0].type: Forbidden: must be empty to be "
            "structural") in err.getvalue()

