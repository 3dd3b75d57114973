"""sample/grammar.py without a model: which JSON-Schema keywords are refused as unenforceable, and where."""

from kvfleet_server.sample.grammar import find_unenforced_keyword


def test_unenforced_keywords_are_found_with_their_path():
    assert find_unenforced_keyword({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}) == \
        "properties.a.not"
    assert find_unenforced_keyword({"type": "array", "items": {"anyOf": [{"type": "integer"},
                                                                        {"type": "array", "uniqueItems": True}]}}) == \
        "items.anyOf.1.uniqueItems"
    assert find_unenforced_keyword({"$defs": {"x": {"if": {"minimum": 1}}}, "$ref": "#/$defs/x"}) == "$defs.x.if"


def test_enforced_schemas_and_property_names_are_not_flagged():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "contains": {"type": "integer",
                                                                                      "multipleOf": 3}},
              "required": ["not", "if"], "uniqueItems": False, "enum": [{"not": 1}], "description": "if then else"}
    assert find_unenforced_keyword(schema) is None
