"""The third set of lowering rules (issue 28 part 2): cases refused before, now exact, or still
refused by name.

- `allOf` of several parts: `$ref`s and `required` across them, a closed part against another
  part's required key (no object is left), two conditions, two `not`s (merge.py, lower.py);
- `uniqueItems` on arrays of at most one item, or of items with a few listed values
  (unique_items.py);
- patternProperties beside declared names they match, patterns of a few names, one class of
  other keys (objects.py, regex/finite.py);
- `dependencies`, `dependentRequired`, `dependentSchemas` by a case split on presence, with
  patternProperties too (objects.py);
- `if` on properties of any schema, and on several (conditionals.py);
- `not` of literals beside a pattern some value matches, on a type list, on numbers, without
  a type (not_rules.py, regex/finite.py);
- the root's definitions kept at the root whatever its rewrites (lower.py).

Each case compiles the ORIGINAL schema through the compiler (lower, check, close, patterns as
EBNF) and `jsonschema` on the original is the judge: random walks through the grammar all
validate, the valid instances listed are accepted, the invalid ones rejected, and the rule is
reported narrowed exactly when it is one (rules2's protocol).
"""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from prescient.grammar import GrammarError
from prescient.grammar.regex.finite import finite_strings, without_strings
from prescient.grammar.regex.product import anchors_inside, both, without_matches
from prescient.grammar.schema.formats import EXACT
from prescient.grammar.schema.lower import lower_schema
from prescient.grammar.schema.merge import Unmergeable, merge

from .test_grammar_schema_rules2 import check_rule, walker  # noqa: F401  (the walker fixture)

D7 = "http://json-schema.org/draft-07/schema#"
MD5 = "0123456789abcdef0123456789abcdef"
UUID = "0123abcd-89ab-cdef-0123-456789abcdef"
PATH = "^(\\/?((\\.{2})|([a-z0-9\\-]*))($|\\/))*$"  # a Github_hard path type
ABC = {"enum": ["a", "b", "c"]}

# (name, schema, valid instances that must be accepted, invalid instances, narrowing rule or None)
CASES = [
    # --- allOf -------------------------------------------------------------------------------
    ("allOf of several references, required across them", {
        "definitions": {
            "named": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            "aged": {"properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}},
        "allOf": [{"$ref": "#/definitions/named"}, {"$ref": "#/definitions/aged"},
                  {"properties": {"tag": {"enum": ["x"]}}}]},
     ['{"name": "a", "age": 1}', '{"name": "a", "age": 0, "tag": "x"}'],
     ['{"name": "a"}', '{"age": 1}', '{"name": "a", "age": -1}', '{"name": "a", "age": 1, "tag": "y"}'], None),
    ("allOf of a closed part and a part requiring another key: no object", {
        "type": "object", "properties": {"items": {"type": "array", "items": {"allOf": [
            {"type": "object", "properties": {"w": {"type": "number"}}, "additionalProperties": False},
            {"required": ["id"]}]}}}},
     ['{"items": []}'], ['{"items": [{"w": 1}]}', '{"items": [{}]}'], None),
    ("a required key an untyped object forbids: only non-objects are left", {
        "properties": {"a": {"$ref": "#/definitions/none"}}, "required": ["a"], "additionalProperties": False,
        "definitions": {"none": {"type": "object", "required": ["id"], "additionalProperties": False}}},
     ["1", '"s"', "null", "[]"], ["{}", '{"a": {}}'], None),
    ("allOf of two conditions", {
        "type": "object", "properties": {"k": {"enum": ["a", "b"]}, "x": {"type": "string"},
                                         "y": {"type": "string"}},
        "allOf": [{"if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["x"]}},
                  {"if": {"properties": {"k": {"const": "b"}}}, "then": {"required": ["y"]}}]},
     ['{"k": "a", "x": "1"}', '{"k": "b", "y": "2"}', '{"x": "1", "y": "2"}'],
     ['{"k": "a"}', '{"k": "b", "x": "1"}', "{}"], None),
    ("allOf of two patterns: both found in the string", {
        "type": "string", "allOf": [{"pattern": "^[a-z]+"}, {"pattern": "[0-9]$"}]},
     ['"ab1"', '"a-9"'], ['"ab"', '"1"', '"1a"'], None),
    ("allOf of two patterns no string matches: the other types", {
        "type": ["string", "null"], "allOf": [{"pattern": "^a"}, {"pattern": "^b"}]},
     ["null"], ['"a"', '"b"', '"ab"'], None),
    ("allOf of two nots", {"type": "string", "allOf": [{"not": {"const": "a"}}, {"not": {"enum": ["b", "c"]}}]},
     ['"d"', '""', '"ab"'], ['"a"', '"b"', '"c"'], None),
    # --- uniqueItems -------------------------------------------------------------------------
    ("uniqueItems over an enum: every order, no repeat", {
        "type": "array", "items": ABC, "uniqueItems": True},
     ["[]", '["a"]', '["c", "a"]', '["b", "c", "a"]'], ['["a", "a"]', '["a", "b", "a"]', '["d"]'], None),
    ("uniqueItems over booleans, at least one", {
        "type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
     ["[true]", "[false, true]", "[true, false]"], ["[]", "[true, true]", "[false, false]"], None),
    ("uniqueItems over a short integer range, at most two", {
        "type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "uniqueItems": True,
        "maxItems": 2},
     ["[3, 1]", "[2]", "[]"], ["[1, 1]", "[1, 2, 3]", "[4]"], None),
    ("uniqueItems over an enum that the item's type filters", {
        "type": "array", "items": {"type": "string", "enum": ["a", 1, "b"]}, "uniqueItems": True},
     ['["b", "a"]'], ["[1]", '["a", "a"]'], None),
    ("uniqueItems on arrays of at most one item", {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1},
     ['["x"]', "[]"], ['["x", "y"]'], None),
    ("uniqueItems on an array or null", {
        "type": ["array", "null"], "items": {"enum": ["x", "y"]}, "uniqueItems": True},
     ["null", '["y", "x"]'], ['["x", "x"]', '"x"'], None),
    ("uniqueItems beside an anyOf, merged into its branches", {
        "uniqueItems": True, "anyOf": [{"type": "array", "items": {"enum": ["x", "y"]}}, {"type": "string"}]},
     ['["y", "x"]', '"s"'], ['["x", "x"]'], None),
    # --- patternProperties -------------------------------------------------------------------
    ("patternProperties matching a declared name", {
        "type": "object", "properties": {"normal": {"type": "integer"}},
        "patternProperties": {"^[a-z]+$": {"type": "integer", "minimum": 0}}, "additionalProperties": False},
     ['{"normal": 1, "shift": 2}', '{"shift": 0}', "{}"],
     ['{"normal": -1}', '{"shift": -1}', '{"Shift": 1}', '{"normal": "x"}'], None),
    ("patterns of a few names declare them", {
        "type": "object", "additionalProperties": False, "patternProperties": {
            "^[a-z0-9_-]+$": {"type": "string"}, "^MD(5|6)$": {"type": "string", "pattern": "^[a-f0-9]{32}$"}}},
     ['{"md5x": "x"}', f'{{"MD5": "{MD5}", "a": "b"}}', f'{{"MD6": "{MD5}"}}'],
     ['{"MD5": "x"}', '{"A": "x"}', '{"a": 1}'], None),
    ("a pattern whose names are forbidden", {
        "type": "object", "additionalProperties": False, "patternProperties": {
            "^\\w[-\\w_]*$": {}, "^(relationships|links)$": False}},
     ['{"a": 1, "b-c": []}', '{"linksx": 1}'], ['{"links": 1}', '{"relationships": 2}', '{"-a": 1}'], None),
    ("a pattern whose names are forbidden by `not: {}`", {
        "type": "object", "additionalProperties": False, "patternProperties": {
            "^\\w[-\\w_]*$": {}, "^(relationships|links)$": {"not": {}}}},
     ['{"a": 1}'], ['{"links": 1}', '{"relationships": 2}'], None),
    ("patternProperties beside declared names, closed by the engine", {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
        "patternProperties": {"^x-": {"type": "string"}}},
     ['{"name": "a", "x-b": "c"}', '{"name": "a"}'], ['{"name": "a", "x-b": 1}', "{}"], None),
    ("several patterns of one schema", {
        "type": "object", "additionalProperties": False,
        "patternProperties": {"^a": {"type": "integer"}, "^b": {"type": "integer"}}},
     ['{"ab": 1, "bc": 2}', "{}"], ['{"c": 1}', '{"a": "x"}'], None),
    ("patternProperties on an object open to other keys: only the patterns' (narrower)", {
        "type": "object", "patternProperties": {"^[0-9]+$": {"type": "string"}},
        "properties": {"id": {"type": "integer"}}, "additionalProperties": True},
     ['{"id": 1, "12": "x"}'], ['{"id": 1, "12": 3}'], "patternProperties (only matching names)"),
    # --- dependencies ------------------------------------------------------------------------
    ("dependencies: four names all or none", {
        "$schema": D7, "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"},
                       "d": {"type": "integer"}},
        "dependencies": {"a": ["b", "c", "d"], "b": ["a", "c", "d"], "c": ["a", "b", "d"], "d": ["a", "b", "c"]}},
     ["{}", '{"a": 1, "b": 2, "c": 3, "d": 4}'], ['{"a": 1}', '{"a": 1, "b": 2, "c": 3}', '{"d": 1}'], None),
    ("dependencies beside patternProperties", {
        "$schema": D7, "type": "object", "properties": {"mem": {"type": "integer"}, "swap": {"type": "integer"}},
        "patternProperties": {"^x-": {}}, "additionalProperties": False, "dependencies": {"swap": ["mem"]}},
     ['{"mem": 2, "swap": 1, "x-a": 3}', '{"x-b": 1}', '{"mem": 1}'], ['{"swap": 1}', '{"y": 1}'], None),
    ("dependentRequired", {
        "type": "object", "properties": {"card": {"type": "string"}, "addr": {"type": "string"}},
        "dependentRequired": {"card": ["addr"]}},
     ['{"card": "1", "addr": "x"}', '{"addr": "x"}', "{}"], ['{"card": "1"}'], None),
    ("dependentSchemas", {
        "type": "object", "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
        "dependentSchemas": {"card": {"required": ["cvv"], "properties": {"cvv": {"minLength": 3}}}}},
     ['{"card": "1", "cvv": "123"}', '{"cvv": "1"}'], ['{"card": "1"}', '{"card": "1", "cvv": "12"}'], None),
    # --- if / then / else --------------------------------------------------------------------
    ("if on a property's type", {
        "type": "object", "properties": {"type": {"type": ["string", "integer"]}, "n": {"type": "integer"}},
        "if": {"properties": {"type": {"type": "string"}}, "required": ["type"]}, "then": {"required": ["n"]}},
     ['{"type": "a", "n": 1}', '{"type": 1}', "{}"], ['{"type": "a"}'], None),
    ("if on two properties, with else", {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}, "c": {"type": "string"}},
        "if": {"properties": {"a": {"const": "x"}, "b": {"const": True}}},
        "then": {"required": ["c"]}, "else": {"properties": {"c": False}}},
     ['{"a": "x", "b": true, "c": "s"}', '{"a": "y"}', '{"a": "x", "b": false}'],
     ['{"a": "x", "b": true}', '{"a": "y", "c": "s"}', '{"b": false, "c": "s"}'], None),
    # --- not ---------------------------------------------------------------------------------
    ("not enum beside a pattern that allows a value", {
        "type": "string", "pattern": "^[a-z]{2,8}$", "not": {"enum": ["test", "source"]}},
     ['"tests"', '"ab"', '"sourc"'], ['"test"', '"source"', '"a"'], None),
    ("not of a referenced enum beside a pattern", {
        "definitions": {"prim": {"enum": ["int", "string"]}}, "type": "string", "pattern": "^[a-z]+$",
        "not": {"$ref": "#/definitions/prim"}},
     ['"foo"', '"ints"'], ['"int"', '"string"'], None),
    ("not of a pattern beside a pattern", {
        "type": "string", "pattern": "^[a-z-]+$", "not": {"pattern": "plugin$"}},
     ['"ab-c"', '"plugins"', '"plug"'], ['"my-plugin"', '"plugin"', '"AB"'], None),
    ("not of a blank pattern", {"type": "string", "not": {"pattern": "^\\s*$"}},
     ['"a"', '" a "'], ['""', '"  "', '"\\n"'], None),
    ("not enum on a type list", {"type": ["string", "null", "boolean"], "not": {"enum": [None, "", True]}},
     ['"x"', "false"], ["null", '""', "true"], None),
    ("not const on numbers", {"type": "number", "not": {"const": 0}},
     ["1.5", "-2", "3"], ["0"], None),
    ("not enum without a type", {"not": {"enum": ["a", 1]}},
     ['"b"', "2", "null", "[]", "{}"], ['"a"', "1"], None),
    ("a required name undeclared, on an object or null", {
        "type": ["object", "null"], "properties": {"id": {"type": "integer"}}, "required": ["id", "name"]},
     ["null", '{"id": 1, "name": 2}'], ['{"id": 1}', '"x"'], None),
    # --- anchors inside a pattern -------------------------------------------------------------
    ("a $ inside a repeated group", {"type": "string", "pattern": PATH},
     ['"a/b"', '"../x/"', '""', '"/a"'], ['"a$"', '"A"', '"a//b."'], None),
    # --- format + pattern ----------------------------------------------------------------------
    ("uuid beside a pattern: intersected", {"type": "string", "format": "uuid", "pattern": "^0"},
     [f'"{UUID}"'], [f'"1{UUID[1:]}"'], None),
    # --- the root's definitions --------------------------------------------------------------
    ("a root anyOf of one reference beside a type keeps its definitions", {
        "type": "object", "anyOf": [{"$ref": "#/definitions/top"}],
        "definitions": {"top": {"properties": {"b": {"$ref": "#/definitions/b"}}},
                        "b": {"type": "integer"}}},
     ['{"b": 1}'], ['{"b": "x"}'], None),
    ("a root case split keeps its definitions", {
        "$schema": D7, "type": "object", "definitions": {"n": {"type": "integer"}},
        "properties": {"a": {"$ref": "#/definitions/n"}, "b": {"$ref": "#/definitions/n"}},
        "dependencies": {"a": ["b"]}},
     ['{"a": 1, "b": 2}', '{"b": 2}'], ['{"a": 1}', '{"a": "x", "b": 1}'], None),
]


@pytest.mark.parametrize("name,schema,valid,invalid,rule", CASES, ids=[c[0] for c in CASES])
def test_rule_is_exact_and_every_walk_validates(walker, name, schema, valid, invalid, rule):
    check_rule(walker, name, schema, valid, invalid, rule, seed=11, walks=60)


@pytest.mark.parametrize("schema,feature", [
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "items": {"enum": list("abcdef")}, "uniqueItems": True}, "uniqueItems"),  # 1957 arrays
    ({"type": "array", "prefixItems": [{"const": "a"}], "items": {"enum": ["a", "b"]}, "uniqueItems": True},
     "uniqueItems"),
    ({"$schema": D7, "type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"},
      "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"minProperties": 2},
      "then": {"required": ["a"]}}, "if"),
    ({"type": "string", "format": "uri", "pattern": "^https://x\\.com/.*\\.(gif|jpg)$"}, "format+pattern"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "^((?!mode).)*$"}]}, "allOf"),  # lookahead
])
def test_still_refused_by_name(walker, schema, feature):
    with pytest.raises(GrammarError) as info:
        walker.prepare_schema(schema)
    assert info.value.feature == feature


def test_keys_the_lowering_wrote_take_no_new_declared_name():
    """A propertyNames the lowering wrote leaves out the names declared then; a merge that would
    declare another (which those keys may hold) is refused rather than let it in twice."""
    lowered = {"type": "object", "additionalProperties": {"type": "integer"},
               "propertyNames": {"type": "string", "pattern": "^(?:x[0-9])$", "x-prescient-other-names": True}}
    with pytest.raises(Unmergeable):
        merge(lowered, {"properties": {"x1": {"type": "string"}}})
    assert merge(lowered, {"minProperties": 1})["minProperties"] == 1


def test_two_patterns_no_string_matches_on_a_string_are_unsatisfiable():
    with pytest.raises(GrammarError) as info:
        lower_schema({"type": "string", "allOf": [{"pattern": "^a"}, {"pattern": "^b"}]})
    assert info.value.feature == "unsatisfiable"


def test_more_items_than_values_is_unsatisfiable():
    with pytest.raises(GrammarError) as info:
        lower_schema({"type": "array", "items": {"enum": ["a"]}, "uniqueItems": True, "minItems": 2})
    assert info.value.feature == "unsatisfiable"


def test_a_clients_mark_is_not_trusted(walker):
    """The mark that lets a lowered propertyNames stand beside properties is the lowering's
    own: in a client's schema it is dropped, and the usual refusal stands."""
    schema = {"type": "object", "properties": {"a": {}},
              "propertyNames": {"pattern": "^x", "x-prescient-other-names": True}}
    with pytest.raises(GrammarError) as info:
        walker.prepare_schema(schema)
    assert info.value.feature == "propertyNames+properties"


@pytest.mark.parametrize("pattern,names", [
    ("^[a-z]{1,3}$", ["ab", "a", "abc", "zz"]),
    ("^(ab|a)*$", ["", "ab", "aab"]),
    (".+", ["xy", "x"]),
    ("^\\d+$", ["12", "1"]),
    ("^[A-Za-z][A-Za-z0-9]*(\\.[A-Za-z][A-Za-z0-9]*)*$", ["normal", "a.b"]),
    ("^[^x]?y$", ["y", "ay"]),
    ("\\w+", ["ab_"]),
    ("^a?$", [""]),
    ("^x.*y$", ["xy", "xay"]),
])
def test_pattern_without_strings_is_exact(pattern, names):
    """Checked on every short string over the names' characters and a few more (Python's `re`
    agrees with the engine's reading on these ASCII strings)."""
    out = without_strings(pattern, names)
    core = pattern[1:-1] if pattern.startswith("^") else pattern
    alphabet = sorted(set("".join(names)) | {"z", "1", "."})
    for n in range(5):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            expected = bool(re.fullmatch(core, s)) and s not in names
            assert bool(out and re.fullmatch(out, s)) == expected, (pattern, s)


def test_pattern_without_strings_reads_a_search_when_asked():
    out = without_strings("^x-", ["x-a"], search=True)
    assert re.fullmatch(out, "x-b") and re.fullmatch(out, "x-ab") and not re.fullmatch(out, "x-a")
    assert not re.fullmatch(out, "y-b")
    assert without_strings("^(a|b)$", ["a", "b"]) is None


@pytest.mark.parametrize("a,b", [("^[a-z]+$", "^[a-c0-9]{2,3}$"), ("^a", "b$"), ("^(ab)*$", "^a(ba)*b$"),
                                 ("x", "y"), ("^\\d+$", "^[0-5]+$"), ("^[^a]*$", "a")])
def test_two_patterns_as_one_is_exact(a, b):
    """Every short string is in the written pattern exactly when both patterns are found in it."""
    out = both(a, b, search=True)
    for n in range(6):
        for chars in itertools.product("abxy01", repeat=n):
            s = "".join(chars)
            expected = bool(re.search(a, s) and re.search(b, s))
            assert bool(out and re.fullmatch(out, s)) == expected, (a, b, s, out)


@pytest.mark.parametrize("a,b", [("^[a-z]+$", "ab"), (None, "^\\s*$"), ("^(ab)*$", "^abab"), ("^[a-z-]+$", "plugin$"),
                                 ("^x+$", "x")])
def test_pattern_without_the_others_matches_is_exact(a, b):
    out = without_matches(a, b)
    for n in range(6):
        for chars in itertools.product("abx -", repeat=n):
            s = "".join(chars)
            expected = (a is None or bool(re.fullmatch(a[1:-1], s))) and not re.search(b, s)
            assert bool(out and re.fullmatch(out, s)) == expected, (a, b, s, out)


def test_a_pattern_under_not_is_read_as_either_dialect_would():
    """A string Python's `re` finds `\\s` in is out, though ECMA-262 would not call \\x1c a
    space; so is one that `$` matches before its final newline."""
    out = without_matches(None, "^\\s*$")
    assert not re.fullmatch(out, "\x1c") and not re.fullmatch(out, "\n") and re.fullmatch(out, "a")
    out = without_matches(None, "^a$")
    assert not re.fullmatch(out, "a") and not re.fullmatch(out, "a\n") and re.fullmatch(out, "a\n\n")


@pytest.mark.parametrize("fmt", sorted(EXACT))
def test_exact_format_regexes_are_xgrammars(fmt):
    """The fact formats.py intersects on: xgrammar's grammar for the format accepts a string
    exactly when the regex matches it (sampled: valid values mutated one character at a time)."""
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": fmt}))
    regex = re.compile(EXACT[fmt])
    rng = random.Random(2)
    seeds = {"uuid": [UUID, UUID.upper(), "ffffffff-0000-aaaa-BBBB-123456789012"]}[fmt]
    for seed in seeds:
        for _ in range(200):
            s = list(seed)
            for _ in range(rng.randint(0, 2)):
                s[rng.randrange(len(s))] = rng.choice("0aFg-x.Z9 ")
            text = "".join(s)[:rng.choice([len(s), len(s) - 1, len(s)])] + rng.choice(["", "", "0"])
            assert _is_grammar_accept_string(grammar, json.dumps(text)) == bool(regex.fullmatch(text)), text


@pytest.mark.parametrize("pattern", [PATH, "^(a$|b)*$", "^(ab|a$)+$", "^x(y|$)$"])
def test_a_pattern_with_an_end_inside_is_restated_exactly(pattern):
    out = anchors_inside(pattern)
    for n in range(6):
        for chars in itertools.product("ab./xy", repeat=n):
            s = "".join(chars)
            assert bool(out and re.fullmatch(out, s)) == bool(re.fullmatch(pattern, s)), (pattern, s, out)


def test_finite_strings():
    assert finite_strings("^(relationships|links)$") == ["links", "relationships"]
    assert finite_strings("^MD[56]$") == ["MD5", "MD6"]
    assert finite_strings("^a+$") is None  # unbounded
    assert finite_strings("x") is None  # unanchored: a search finds it in infinitely many
    assert finite_strings("^[a-z]{3}$", limit=64) is None  # 17576 strings
