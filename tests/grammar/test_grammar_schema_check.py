"""Refused schema features: each raises GrammarError naming the feature, and each has a canary
showing that xgrammar really drops it (it accepts an instance violating only that feature), so
an xgrammar upgrade that starts enforcing a feature fails here instead of staying refused."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from prescient.grammar import GrammarError, GrammarSpec, check_schema
from prescient.latency_bench.bundled import JSONSCHEMABENCH, jsonschemabench_file

# The bundled JSONSchemaBench sample (latency_bench/jsonschemabench-sample);
# test_grammar_schema_lower imports this name.
DATA = JSONSCHEMABENCH

OBJ_AB = {"type": "object", "properties": {"a": {}, "b": {}}}

# (feature named in the error, schema, an instance that violates only that feature)
REFUSED = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, '["a"]'),
    ("minContains", {"type": "array", "contains": {"type": "integer"}, "minContains": 2},
     '["a",1]'),
    ("maxContains", {"type": "array", "contains": {"type": "integer"}, "maxContains": 1},
     "[1,2]"),
    ("patternProperties", {"type": "object", "additionalProperties": False,
                           "patternProperties": {"^x": {"type": "integer"}}}, "{}"),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": {}},
                               "unevaluatedProperties": False}, '{"b":1}'),
    ("dependentRequired", dict(OBJ_AB, dependentRequired={"a": ["b"]}), '{"a":1}'),
    ("dependentSchemas", dict(OBJ_AB, dependentSchemas={"a": {"required": ["b"]}}), '{"a":1}'),
    ("dependencies", dict(OBJ_AB, dependencies={"a": ["b"]}), '{"a":1}'),
    ("if", dict(OBJ_AB, **{"if": {"required": ["a"]}, "then": {"required": ["b"]}}), '{"a":1}'),
    ("not", {"type": "object", "not": {"required": ["a"]}}, '{"a":1}'),
    ("allOf", {"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, "6"),
    ("allOf+properties", {"properties": {"a": {"type": "integer"}},
                          "allOf": [{"required": ["a"]}]}, "{}"),
    ("anyOf+minimum", {"type": "integer", "minimum": 0, "anyOf": [
        {"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 10}]}, "-1"),
    ("anyOf+type", {"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]}, "1"),
    ("oneOf+properties", {"type": "object", "properties": {"c": {"type": "integer"}},
                          "required": ["c"], "oneOf": [{"type": "object"}]}, "{}"),
    ("oneOf", {"oneOf": [{"enum": ["a", "b"]}, {"enum": ["a"]}]}, '"a"'),
    ("oneOf", {"oneOf": [{"type": "string", "maxLength": 2},
                         {"type": "string", "minLength": 1}]}, '"a"'),
    ("enum+minLength", {"type": "string", "enum": ["a", "abc"], "minLength": 2}, '"a"'),
    ("enum+type", {"type": "string", "enum": ["a", 1]}, "1"),
    ("const+type", {"type": "integer", "const": "x"}, '"x"'),
    ("$ref+minimum", {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 3},
     "1"),
    ("$ref", {"$defs": {"a": {"$anchor": "foo", "type": "integer"}},
              "properties": {"x": {"$ref": "#foo"}}}, '{"x":"s"}'),
    ("$ref", {"$ref": "http://example.com/a.json"}, "1"),
    ("required", {"type": "object", "properties": {"a": {}}, "required": ["b"]}, '{"a":1}'),
    ("minLength", {"minLength": 3}, '"a"'),
    ("pattern", {"pattern": "^a$"}, '"b"'),
    ("format", {"format": "date"}, '"x"'),
    ("maxProperties", {"maxProperties": 1}, '{"a":1,"b":2}'),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, "0.3"),
    ("multipleOf", {"type": "number", "multipleOf": 2}, "3"),
    ("propertyNames+properties", {"type": "object", "properties": {"abc": {}},
                                  "propertyNames": {"maxLength": 2}}, '{"abc":1}'),
    ("multipleOf+range", {"type": "integer", "multipleOf": 7, "minimum": 0}, "8"),
    ("multipleOf+range", {"type": "integer", "multipleOf": 7, "minimum": 0,
                          "exclusiveMaximum": 10001}, "8"),
    ("format:iri", {"type": "string", "format": "iri"}, '"nope"'),
    ("format:iri-reference", {"type": "string", "format": "iri-reference"}, '"a b"'),
    ("format:idn-hostname", {"type": "string", "format": "idn-hostname"}, '"a b"'),
    ("format:idn-email", {"type": "string", "format": "idn-email"}, '"nope"'),
    ("format:regex", {"type": "string", "format": "regex"}, '"("'),
    ("format+minLength/maxLength", {"type": "string", "format": "date", "maxLength": 5},
     '"2020-01-01"'),
    ("format+pattern", {"type": "string", "format": "date", "pattern": "^2020"},
     '"2021-01-01"'),
    ("pattern+minLength/maxLength", {"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"'),
    ("pattern:lookaround", {"type": "string", "pattern": "^(?=a)[a-z]+$"}, '"b"'),
    ("pattern:lookaround", {"type": "string", "pattern": "^(?!a)[a-z]+$"}, '"ab"'),
    ("pattern:anchor", {"type": "string", "pattern": "a^b"}, '"ab"'),
    ("pattern:anchor", {"type": "string", "pattern": "(a$|c)b"}, '"ab"'),
    ("pattern:anchor", {"type": "string", "pattern": "(^a|b)*"}, '"ba"'),  # '^' in a repeat
]


def _xgrammar_accepts(schema, instance: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=False)
    return _is_grammar_accept_string(grammar, instance)


@pytest.mark.parametrize("feature,schema,instance", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_feature_is_named(feature, schema, instance):
    with pytest.raises(GrammarError) as info:
        check_schema(schema)
    assert info.value.feature == feature
    for word in re.split(r"[+:/]", feature):
        assert word in str(info.value)


@pytest.mark.parametrize("feature,schema,instance", REFUSED, ids=[r[0] for r in REFUSED])
def test_canary_xgrammar_drops_it(feature, schema, instance):
    assert _xgrammar_accepts(schema, instance), f"xgrammar now enforces {feature}: allow it"


# Supported: xgrammar rejects the violating instance, and check_schema lets the schema through.
SUPPORTED = [
    ({"type": "string", "minLength": 2}, '"a"'),
    ({"type": "string", "pattern": "^[a-z]+$"}, '"A"'),
    ({"type": "string", "pattern": "^a$|^b$"}, '"ab"'),
    ({"type": "integer", "minimum": 1, "maximum": 9}, "10"),
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "exclusiveMaximum": 10000}, "8"),
    ({"type": "integer", "multipleOf": 7, "exclusiveMinimum": -1, "maximum": 9999}, "8"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1,2]"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, '{"b":1}'),
    ({"type": "object", "minProperties": 1}, "{}"),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A":1}'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "description": "d"}, "1"),
    ({"type": "object", "anyOf": [{"type": "object", "required": ["a"],
                                   "properties": {"a": {"type": "integer"}}}]}, "{}"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
     '{"k":"c"}'),
    ({"allOf": [{"type": "integer", "maximum": 3}], "description": "d"}, "4"),
    ({"type": ["string", "null"], "enum": ["a", None]}, '"b"'),
    ({"$defs": {"a": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/a",
                                                               "description": "d"}}},
     '{"x":"s"}'),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
      "$ref": "#/$defs/n"}, '{"c":1}'),
    ({"type": "string", "format": "date-time"}, '"yesterday"'),
    ({"type": "string", "format": "email"}, '"nope"'),
    ({"type": "string", "format": "uuid"}, '"nope"'),
    ({"type": "string", "format": "ipv4"}, '"1.2.3"'),
    ({"type": "string", "format": "url", "maxLength": 3}, '"abcd"'),  # unknown format: annotation
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, '["a"]'),
]


@pytest.mark.parametrize("schema,instance", SUPPORTED,
                         ids=[json.dumps(s)[:40] for s, _ in SUPPORTED])
def test_supported_feature_is_enforced(schema, instance):
    check_schema(schema)
    assert not _xgrammar_accepts(schema, instance)


def test_compiler_refuses_with_feature_name(toy_compiler):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(GrammarError, match="uniqueItems") as info:
        toy_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert info.value.path == "#/properties/tags"


def test_real_tool_schemas_pass_the_check():
    """The BFCL tool schemas (the tool-calling workload; the bundled 150 of 1043) use nothing
    refused; on the GlaiveAI function schemas (bundled whole: all 1707) refusals stay rare and
    are for genuinely dropped features."""
    bfcl = [json.loads(line)["schema"] for line in open(jsonschemabench_file("maskbench_bfcl.jsonl"))]
    for schema in bfcl:
        check_schema(schema)
    refused = []
    for line in open(jsonschemabench_file("Glaiveai2K.jsonl")):
        try:
            check_schema(json.loads(line)["schema"])
        except GrammarError as err:
            refused.append(err.feature)
    assert len(refused) < 0.05 * 1707
    assert set(refused) <= {"oneOf+properties", "oneOf+type", "anyOf+properties", "dependencies"}
