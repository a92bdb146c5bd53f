"""The second set of lowering rules (issue 18): disjoint `oneOf` proofs (disjoint.py,
regex_overlap.py), shared singletons (one_of_singletons.py), fractional `multipleOf`
(fractional_step.py), `format` beside lengths and patterns (formats.py), `not` (not_rules.py),
`if`/`then`/`else` (conditionals.py), several patternProperties, propertyNames by reference,
and two looser shapes found by the Github_hard walks.

Each case compiles the ORIGINAL schema through the compiler (lower, check, close, patterns as
EBNF) and checks, with `jsonschema` on the original as the judge:
- random walks through the grammar all validate (the fuzzed invariant);
- instances the original accepts that an exact rule must keep are accepted;
- instances the original rejects are rejected;
- the rule is reported narrowed exactly when it is one.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarError, GrammarSpec, GrammarTokenizer
from prescient.grammar.schema.disjoint import Disjointness
from prescient.grammar.schema.formats import _NONEMPTY
from prescient.grammar.schema.fractional_step import _passes
from prescient.grammar.schema.not_rules import _except_strings
from prescient.grammar.schema.regex_overlap import disjoint, within
from prescient.latency_bench.grammar_compliance import _WALK_STOP, _WALK_VOCAB, random_walk

D4 = "http://json-schema.org/draft-04/schema#"
UUID = "0123abcd-89ab-cdef-0123-456789abcdef"

# (name, schema, valid instances that must be accepted, invalid instances, narrowing rule or None)
CASES = [
    ("oneOf told apart by types and forbidden keys", {"oneOf": [
        {"type": "string"}, {"type": "number"},
        {"type": "object", "properties": {"$date": {"type": "integer"}}, "required": ["$date"],
         "additionalProperties": False},
        {"type": "object", "patternProperties": {"^[^$]": {"type": "integer"}},
         "additionalProperties": False}]},
     ['"x"', "1.5", '{"$date": 1}', '{"a": 1}'], ['{"$date": "x"}', "null"], None),
    ("oneOf of string patterns", {"type": "array", "items": {"oneOf": [
        {"type": "string", "pattern": "^[^:]+$"}, {"type": "string", "pattern": "^[^:]+:[^:]+:[0-9]+$"}]}},
     ['["abc", "a:b:1"]'], ['["a:b"]'], None),
    ("oneOf told apart by lengths", {"oneOf": [
        {"type": "string", "maxLength": 0}, {"type": "string", "format": "html-selector", "minLength": 1}]},
     ['""', '"div"'], ["1"], None),
    ("oneOf: a pattern against the empty string only", {"oneOf": [
        {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"}, {"type": "string", "maxLength": 0}]},
     ['""', '"1.2"'], ['"x"'], None),
    ("oneOf: a key the other branch forbids", {"oneOf": [
        {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]},
        {"type": "object", "properties": {"circular": {"type": "boolean"}}, "required": ["circular"],
         "additionalProperties": False}]},
     ['{"type": "x"}', '{"circular": true}'], ['{}'], None),
    ("oneOf: a value rejected by the other branch's not", {"type": "object", "properties": {
        "t": {"oneOf": [{"type": "string", "enum": ["a", "b"]},
                        {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}]}}},
     ['{"t": "a"}', '{"t": {"x": 1}}'], ['{"t": "c"}'], None),
    ("oneOf sharing null", {"oneOf": [
        {"type": ["object", "null"], "properties": {"k": {"enum": ["name"]}}, "required": ["k"],
         "additionalProperties": False},
        {"type": ["object", "null"], "properties": {"k": {"enum": ["link"]}}, "required": ["k"],
         "additionalProperties": False}]},
     ['{"k": "name"}', '{"k": "link"}'], ["null", '{"k": "x"}'], None),
    ("oneOf sharing the empty array", {"oneOf": [
        {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}},
        {"type": "array", "maxItems": 3, "items": {"enum": ["c"]}}]},
     ['["a", "b"]', '["c"]'], ["[]", '["a", "c"]'], None),
    ("oneOf sharing the empty string", {"oneOf": [{"enum": [""]}, {"type": "string"}]},
     ['"x"'], ['""'], None),
    ("oneOf of a recursive definition (pass 3)", {
        "definitions": {"K": {"type": "object", "oneOf": [
            {"type": "object", "properties": {"E": {"$ref": "#/definitions/K"}}, "required": ["E"]},
            {"type": "object", "properties": {"R": {"type": "string"}}, "required": ["R"]}]}},
        "$ref": "#/definitions/K"},
     ['{"R": "x"}', '{"E": {"R": "x"}}'], ['{}'], None),
    ("a property named $ref", {"type": "object", "properties": {"apis": {"oneOf": [
        {"properties": {"$ref": {"type": "string"}}, "required": ["$ref"]},
        {"properties": {"name": {"type": "string"}}, "required": ["name"]}]}}, "required": ["apis"]},
     ['{"apis": {"$ref": "x"}}', '{"apis": {"name": "y"}}'], ['{"apis": {}}'], None),
    ("multipleOf 0.25 on a range: listed, exact", {"type": "number", "multipleOf": 0.25, "minimum": 0,
                                                 "maximum": 10},
     ["0.25", "9.75", "3"], ["0.3", "10.25", "-0.25"], None),
    ("multipleOf 0.01 unbounded: integers", {"type": "number", "multipleOf": 0.01, "minimum": 0},
     [], ["-1", "0.001"], "fractional multipleOf (integers)"),
    ("multipleOf 0.1 on a range: listed", {"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 1},
     [], ["0.3", "1.1"], "fractional multipleOf (listed multiples)"),
    ("uuid with minLength", {"type": "string", "format": "uuid", "minLength": 1}, [f'"{UUID}"'], ['""'], None),
    ("date-time with minLength", {"type": "string", "format": "date-time", "minLength": 1},
     ['"2020-01-31T10:00:00Z"'], ['""'], None),
    ("hostname with maxLength", {"type": "string", "format": "hostname", "maxLength": 255},
     [], [f'"{"a" * 256}"'], "format with a length (common values)"),
    ("date with a pattern it implies", {"type": "string", "format": "date",
                                        "pattern": "^([0-9]{4})(-([0-9]{2}))?(-([0-9]{2}))?$"},
     ['"2020-01-31"'], ['"20-01"'], None),
    ("uri with a scheme pattern", {"type": "string", "format": "uri", "pattern": "^https?://"},
     [], ['"ftp://x"'], "format with a pattern (common values)"),
    ("format regex", {"type": "string", "format": "regex"}, [], [], "unenforced format (common values)"),
    ("not enum on a string", {"type": "string", "not": {"enum": ["logs", "a.b"]}},
     ['"log"', '"logsx"', '""', '"a"', '"a.bc"'], ['"logs"', '"a.b"'], None),
    ("not enum on a string with a pattern no value matches", {
        "type": "string", "pattern": "^[0-9]+$", "not": {"enum": ["x", "y"]}}, ['"12"'], ['"x"'], None),
    ("not enum on integers", {"type": "integer", "minimum": 1024, "maximum": 65535,
                              "not": {"enum": [6379, 6380, 43215]}},
     ["6378", "6381", "1024", "65535"], ["6379", "6380", "43215", "1023"], None),
    ("not of one character", {"type": "string", "not": {"pattern": "(\\$)"}},
     ['"abc"', '""'], ['"a$b"'], None),
    ("not of two required names, written as allOf", {
        "type": "object", "additionalProperties": False,
        "properties": {"cmd": {"type": "string"}, "args": {"type": "array"}},
        "not": {"allOf": [{"required": ["cmd"]}, {"required": ["args"]}]}},
     [], ['{"cmd": "x", "args": []}'], "not required (a name left out)"),
    ("not of an anyOf of required names", {
        "type": "object", "additionalProperties": False,
        "properties": {"d": {"type": "number"}, "x": {"type": "number"}, "y": {"type": "number"}},
        "not": {"anyOf": [{"required": ["d", "x"]}, {"required": ["d", "y"]}]}},
     [], ['{"d": 1, "x": 2}', '{"d": 1, "y": 2}'], "not required (a name left out)"),
    ("not of a typed object's required name", {
        "type": "object", "properties": {"a": {"type": "integer"}, "n": {"type": "integer"}},
        "not": {"type": "object", "required": ["n"]}},
     [], ['{"n": 1}'], "not required (a name left out)"),
    ("several patternProperties", {"type": "object", "patternProperties": {
        "^netdir_(work|share)$": {"type": "integer"}, "^net_[a-z]+[0-9]+$": {"type": "string"}}},
     ['{"netdir_work": 1, "net_a1": "x"}'], ['{"netdir_work": "x"}'], "patternProperties (only matching names)"),
    ("propertyNames by reference", {
        "definitions": {"dir": {"enum": ["north", "south"]}}, "type": "object",
        "propertyNames": {"$ref": "#/definitions/dir"}, "additionalProperties": {"type": "integer"}},
     ['{"north": 1}', "{}"], ['{"east": 1}'], None),
    ("propertyNames without a type", {"propertyNames": {"pattern": "^value"}},
     [], [], "object keywords without a type"),
    ("patternProperties matching every name, beside propertyNames", {
        "type": "object", "propertyNames": {"enum": ["p10", "p50"]},
        "patternProperties": {".*": {"type": "integer"}}, "additionalProperties": False},
     ['{"p10": 1}', "{}"], ['{"p10": "x"}', '{"p20": 1}'], None),
    ("patternProperties on an object or null", {
        "type": ["object", "null"], "patternProperties": {"^[a-z]+$": {"type": "integer"}},
        "additionalProperties": False},
     ["null", '{"ab": 1}', "{}"], ['{"ab": "x"}', '{"A": 1}'], None),
    ("patternProperties beside properties on an object open by its author", {
        "type": "object", "properties": {"FN": {"type": "string"}}, "required": ["FN"],
        "patternProperties": {"^X-": {"type": "string"}}, "additionalProperties": True},
     ['{"FN": "x", "X-a": "y"}'], ['{"FN": 1}', "{}", '{"FN": "x", "X-a": 1}'],
     "patternProperties (only matching names)"),
    ("a false property on an object open by its author", {
        "type": "object", "additionalProperties": True,
        "properties": {"src": {"type": "string"}, "type": False}},
     ['{"src": "x"}'], ['{"type": 1}'], "false property on an open object (closed)"),
    ("if on one property's value", {
        "type": "object", "properties": {"type": {"type": "string"}, "n": {"type": "integer"}},
        "if": {"properties": {"type": {"const": "action"}}}, "then": {"required": ["n"]}},
     ['{"type": "action", "n": 1}', '{"type": "other"}', '{"n": 2}'], ['{"type": "action"}', "{}"], None),
    ("if with required, then and else", {
        "type": "object", "required": ["kind"],
        "properties": {"kind": {"enum": ["lib", "app"]}, "i18n": {"type": "string"}, "out": {"type": "string"}},
        "if": {"properties": {"kind": {"const": "lib"}}, "required": ["kind"]},
        "then": {"required": ["out"]}, "else": {"required": ["i18n"]}},
     ['{"kind": "lib", "out": "x"}', '{"kind": "app", "i18n": "y"}'],
     ['{"kind": "lib"}', '{"kind": "app", "out": "x"}'], None),
    ("if in draft 4 is no keyword", {
        "$schema": D4, "type": "object", "properties": {"a": {"type": "integer"}},
        "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
     ['{"a": 1}', "{}"], ['{"a": "x"}'], None),
    # found by the Github_hard walks: a `$ref` merged with keywords of another allOf part
    # (drafts 4-7 ignore keywords beside a `$ref`: the merge must not write them there)
    ("draft-4 $ref merged with an allOf sibling's keywords", {
        "$schema": D4, "definitions": {"arr": {"type": "array", "items": {"type": "integer"}}},
        "type": "object", "properties": {"a": {"$ref": "#/definitions/arr"}},
        "allOf": [{"properties": {"a": {"maxItems": 0}}}]},
     ['{"a": []}'], ['{"a": [1]}'], None),
    # a patternProperties value schema that accepts nothing: only the empty object
    ("patternProperties whose values accept nothing", {"type": "object", "patternProperties": {
        "^[0-9]+$": {"type": "object", "properties": {"s": {}}, "required": ["s", "r"],
                     "additionalProperties": False}}},
     [], ['{"1": {}}', '{"1": {"s": 1}}'], "patternProperties (only matching names)"),
]


@pytest.fixture(scope="module")
def walker():
    compiler = GrammarCompiler(GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP]),
                               CompilerConfig(time_limit_s=60.0))
    yield compiler
    compiler.close()


def check_rule(walker, name, schema, valid, invalid, rule, seed=7, walks=40):
    """The rule protocol (shared with rules3): the examples are right about the schema, the
    lowering reports narrowing exactly when `rule` names one, the grammar takes every valid
    example and no invalid one, and random walks through it all validate."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for text in valid:
        assert validator.is_valid(json.loads(text)), f"{name}: {text} is not a valid instance"
    for text in invalid:
        assert not validator.is_valid(json.loads(text)), f"{name}: {text} is a valid instance"
    notes: list[str] = []
    walker.prepare_schema(schema, narrowed=notes)
    if rule is None:
        assert notes == [], f"{name}: exact rule reported narrowed ({notes})"
    else:
        assert rule in notes, f"{name}: {rule!r} not reported ({notes})"
    compiled = walker.compile(GrammarSpec("json_schema", json.dumps(schema)))
    for text in valid:
        assert _is_grammar_accept_string(compiled.handle.grammar, text), f"{name}: rejects valid {text}"
    for text in invalid:
        assert not _is_grammar_accept_string(compiled.handle.grammar, text), f"{name}: accepts invalid {text}"
    rng = random.Random(seed)
    finished = 0
    for _ in range(walks):
        text = random_walk(compiled.matcher(), rng, 300)
        if text is None:
            continue
        finished += 1
        assert validator.is_valid(json.loads(text)), f"{name}: walk {text!r} is invalid"
    assert finished, f"{name}: no walk finished"


@pytest.mark.parametrize("name,schema,valid,invalid,rule", CASES, ids=[c[0] for c in CASES])
def test_rule_is_sound_exact_where_it_says(walker, name, schema, valid, invalid, rule):
    check_rule(walker, name, schema, valid, invalid, rule)


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "string", "format": "hostname"}, {"type": "string", "format": "ipv4"}]},
    {"oneOf": [{"type": "string", "pattern": "^[0-9a-f]{8}$"}, {"type": "string", "pattern": "^[0-9A-F]{8}$"}]},
    {"oneOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]},
    {"oneOf": [{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 10}]},
    {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "array", "items": {"type": "number"}}]},
])
def test_overlapping_one_of_stays_refused(walker, schema):
    """Branches that do share instances (formats are annotations to jsonschema: hostname and
    ipv4 overlap for it) are not made into anyOf."""
    with pytest.raises(GrammarError) as info:
        walker.prepare_schema(schema)
    assert info.value.feature == "oneOf"


def test_pattern_overlap_proofs():
    assert disjoint("^[^:]+$", "^[^:]+:[^:]+:[0-9]+$")
    assert disjoint("^[^:]+:[^:]+:[0-9]+$", "^[^:]+$")
    assert not disjoint("^[0-9a-f]{4}$", "^[0-9A-F]{4}$")  # "1234" matches both
    assert disjoint("APPROVER", "SIGNER")  # the whole string APPROVER has no SIGNER in it
    assert not disjoint("AB", "A")  # "AB" contains a match of A
    assert not disjoint("^\\d$", "^[^0-9]$")  # \d is also a non-ASCII digit for Python's re
    assert within("^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "^([0-9]{4})(-([0-9]{2}))?(-([0-9]{2}))?$")
    assert within("^https://[a-z]+$", "^https?://")
    assert not within("^[0-9]{4}$", "^[0-9]{4}-")
    assert not within("^\\d$", "^[0-9]$")


def test_disjointness_rules_against_jsonschema():
    """Every pair the prover calls disjoint has no common instance among the candidates."""
    schemas = [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 3},
               {"type": "integer", "maximum": 0}, {"type": "number", "exclusiveMinimum": 0},
               {"enum": ["a", 1]}, {"type": "object", "required": ["a"]},
               {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
               {"type": "array", "minItems": 1, "items": {"type": "string"}},
               {"type": "array", "items": {"type": "integer"}}, {"not": {"required": ["a"]}},
               {"anyOf": [{"type": "null"}, {"type": "boolean"}]}]
    candidates = ["", "ab", "abc", -1, 0, 0.5, 1, "a", None, True, {}, {"a": 1}, {"b": 1},
                  {"a": 1, "b": 2}, [], ["x"], [1], [1, "x"]]
    proof = Disjointness({}, lambda ref: {}, lambda v, s: jsonschema.Draft202012Validator(s).is_valid(v))
    proved = 0
    for a, b in itertools.combinations(schemas, 2):
        if proof.disjoint(a, b):
            proved += 1
            both = [c for c in candidates if jsonschema.Draft202012Validator(a).is_valid(c)
                    and jsonschema.Draft202012Validator(b).is_valid(c)]
            assert not both, f"{a} and {b} share {both}"
    assert proved >= 20  # the rules do prove most of these pairs


@pytest.mark.parametrize("values", [["logs"], ["test", "source", "yotta_modules"], ["a", "ab", ""],
                                    ["a.b", "x"], [""], ["[]", "a-b", "^"]])
def test_complement_of_strings_is_exact(values):
    pattern = re.compile("^(?:" + _except_strings(values) + ")$", re.S)
    alphabet = sorted(set("".join(values)) | {"z"})
    for n in range(5):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            assert bool(pattern.match(s)) == (s not in values), s
    for v in values:
        assert not pattern.match(v)
        assert pattern.match(v + "z")


@pytest.mark.parametrize("step", [0.01, 0.1, 0.25, 0.3, 0.05])
def test_fractional_step_test_is_jsonschemas(step):
    validator = jsonschema.Draft202012Validator({"multipleOf": step})
    for value in [0, 1, 3, 7, 0.07, 0.3, 0.5, 0.75, 12.25, 100, 0.1, 0.2, 1e6]:
        assert _passes(value, step) == validator.is_valid(value), (value, step)


def test_integer_multiples_pass_jsonschema():
    """The integer rewrite's claim (n / float(step) rounds to a whole number), sampled."""
    rng = random.Random(3)
    for step, p in ((0.01, 1), (0.1, 1), (0.3, 3), (2.5, 5)):
        validator = jsonschema.Draft202012Validator({"multipleOf": step})
        for _ in range(2000):
            n = p * rng.randrange(-10 ** 12, 10 ** 12)
            assert validator.is_valid(n), (n, step)


@pytest.mark.parametrize("fmt", sorted(_NONEMPTY))
def test_format_grammars_never_produce_the_empty_string(fmt):
    """The fact formats.py drops a minLength of 1 on."""
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": fmt}))
    assert not _is_grammar_accept_string(grammar, '""')


def test_uuid_and_date_have_one_length():
    uuid = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": "uuid"}))
    assert _is_grammar_accept_string(uuid, f'"{UUID}"')
    assert not _is_grammar_accept_string(uuid, f'"{UUID}0"')
    assert not _is_grammar_accept_string(uuid, f'"{UUID[:-1]}"')
    date = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "format": "date"}))
    assert _is_grammar_accept_string(date, '"2020-01-31"')
    assert not _is_grammar_accept_string(date, '"2020-1-31"')
