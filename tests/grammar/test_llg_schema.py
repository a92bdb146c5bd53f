"""The prepared schema said in llguidance's keywords (grammar/llg_schema.py): the rewrite of
other-names `propertyNames` into `patternProperties` and the dropping of annotation formats,
each exact, so llguidance serves schemas it refused before and accepts what xgrammar accepts."""

from __future__ import annotations

import copy
import json
import random

import pytest

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarError, GrammarSpec, GrammarTokenizer
from prescient.grammar.llg_schema import for_llguidance, negation_may_exclude_an_escape
from prescient.grammar.schema.merge import OTHER_NAMES

pytest.importorskip("llguidance")

# docker-compose's shape: declared keys, and any other key only if it starts with "x-"
EXTENSIBLE = {
    "type": "object",
    "properties": {"driver": {"type": "string"}, "internal": {"type": "boolean"}},
    "patternProperties": {"^x-": {"type": "integer"}},
    "additionalProperties": False,
}


def test_other_names_become_one_pattern_property_and_close_the_object():
    node = {"type": "object", "properties": {"a": {"type": "string"}},
            "propertyNames": {"type": "string", "pattern": "^(?:x-.*)$", OTHER_NAMES: True},
            "additionalProperties": {"type": "integer"}}
    out = for_llguidance(node)
    assert "propertyNames" not in out
    assert out["patternProperties"] == {"^(?:x-.*)$": {"type": "integer"}}
    assert out["additionalProperties"] is False
    assert out["properties"] == node["properties"]


def test_a_pattern_matching_a_declared_name_is_left_alone():
    # patternProperties would add the other names' schema to "xa"'s value: not the same schema
    node = {"type": "object", "properties": {"xa": {"type": "string"}},
            "propertyNames": {"pattern": "^x", OTHER_NAMES: True}, "additionalProperties": {"type": "integer"}}
    assert for_llguidance(node) == node


def test_property_names_beyond_a_pattern_are_left_alone():
    node = {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}}
    assert for_llguidance(node) == node


def test_annotation_formats_go_and_standard_ones_stay_at_every_depth():
    node = {"type": "object", "properties": {
        "format": {"type": "string", "format": "url"},  # a property named "format" is no keyword
        "when": {"type": "string", "format": "date-time"},
        "list": {"type": "array", "items": {"anyOf": [{"type": "string", "format": "textarea"}, {"type": "null"}]}}},
        "definitions": {"d": {"type": "string", "format": "uri-reference"}}}
    before = copy.deepcopy(node)
    out = for_llguidance(node)
    assert node == before  # a new tree: the prepared schema (cached by the compiler) is untouched
    props = out["properties"]
    assert set(props) == {"format", "when", "list"}
    assert props["format"] == {"type": "string"}
    assert props["when"]["format"] == "date-time"
    assert props["list"]["items"]["anyOf"][0] == {"type": "string"}
    assert out["definitions"]["d"]["format"] == "uri-reference"  # standard: llguidance's to refuse


@pytest.fixture(scope="module")
def chars():
    from prescient.latency_bench.grammar_compliance import _WALK_STOP, _WALK_VOCAB

    return GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP]), _WALK_STOP


def _accepts(grammar, tokenizer, stop, text: str) -> bool:
    m = grammar.matcher()
    ids = tokenizer.encode(text)
    return m.accept_tokens(ids) == len(ids) and m.accept_token(stop)


@pytest.mark.parametrize("schema", [
    EXTENSIBLE,
    {"type": "object", "properties": {"site": {"type": "string", "format": "url"}}, "required": ["site"]},
], ids=["pattern-properties", "annotation-format"])
def test_llguidance_serves_them_and_accepts_what_xgrammar_accepts(chars, schema):
    jsonschema = pytest.importorskip("jsonschema")
    from prescient.latency_bench.grammar_compliance import random_walk

    tokenizer, stop = chars
    grammars = {}
    for backend in ("llguidance", "xgrammar"):
        c = GrammarCompiler(tokenizer, CompilerConfig(backend=backend))
        try:
            grammars[backend] = c.compile(GrammarSpec("json_schema", json.dumps(schema)))
        finally:
            c.close()
    assert grammars["llguidance"].backend == "llguidance"
    texts = ['{"driver": "a", "x-y": 1}', '{"x-": 2, "internal": true}', '{"y": 1}', '{"x-y": "a"}',
             '{"site": "abc"}', '{"site": 1}', '{}']
    for text in texts:
        verdicts = {b: _accepts(g, tokenizer, stop, text) for b, g in grammars.items()}
        assert verdicts["llguidance"] == verdicts["xgrammar"], (text, verdicts)
        if verdicts["llguidance"]:
            jsonschema.validate(json.loads(text), schema)
    rng = random.Random(3)
    finished = 0
    for _ in range(12):
        text = random_walk(grammars["llguidance"].matcher(), rng, 200)
        if text is not None:
            finished += 1
            jsonschema.validate(json.loads(text), schema)
            assert _accepts(grammars["xgrammar"], tokenizer, stop, text), text
    assert finished >= 3


def test_a_standard_format_llguidance_lacks_is_still_refused_by_name(chars):
    tokenizer, _ = chars
    c = GrammarCompiler(tokenizer, CompilerConfig(backend="llguidance"))
    try:
        with pytest.raises(GrammarError, match="uri-reference") as err:
            c.compile(GrammarSpec("json_schema", json.dumps({"type": "string", "format": "uri-reference"})))
        assert err.value.feature == "llguidance"
    finally:
        c.close()


def test_a_negated_class_excluding_a_quote_or_backslash_goes_to_xgrammar(chars):
    """llguidance 1.9.1 lets `\\"` through `[^,"]` (a "comments" schema of Github_medium: walks
    decoded to strings with the excluded quote): such patterns are refused for it, and auto's
    xgrammar keeps the escape out."""
    tokenizer, stop = chars
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": '^[^,"]+$'}},
              "required": ["name"]}
    for backend, served in (("llguidance", None), ("auto", "xgrammar")):
        c = GrammarCompiler(tokenizer, CompilerConfig(backend=backend))
        try:
            if served is None:
                with pytest.raises(GrammarError, match="character set") as err:
                    c.compile(GrammarSpec("json_schema", json.dumps(schema)))
                assert err.value.feature == "llguidance"
                continue
            grammar = c.compile(GrammarSpec("json_schema", json.dumps(schema)))
            assert grammar.backend == served
            assert _accepts(grammar, tokenizer, stop, '{"name": "ab"}')
            assert not _accepts(grammar, tokenizer, stop, '{"name": "a\\"b"}')
            assert _accepts(grammar, tokenizer, stop, '{"name": "a\\\\b"}')  # a backslash is allowed
        finally:
            c.close()
    with pytest.raises(GrammarError, match="character set"):  # one excluding the backslash
        for_llguidance({"type": "object", "patternProperties": {"^[^\\\\]+$": {}}})
    # classes that cannot exclude an escape stay with llguidance
    for pattern in ("^[^a]+$", "^[^\\n,]+$", '^[a-z"]+$', "^[^\\d]+$"):
        assert for_llguidance({"type": "string", "pattern": pattern})["pattern"] == pattern


@pytest.mark.parametrize("pattern, leaks", [
    ('^[^,"]+$', True), ('^[^"]*$', True), ("^[^\\\\]+$", True), ("^[^\\x22]+$", True),
    ('^[^]"]+$', True),  # a leading ] is a literal: the class still lacks the quote
    ("^[^ -~]+$", True), ("^[^!-/:-@\\[-`{-~]+$", True),  # ranges across the quote or backslash
    ("^[\\x00-\\x21]+$", True),  # not negated, yet every control and no quote
    ('^[^a[b]"]+$', True), ("^[^[:punct:]]+$", True), ("^\\p{L}+$", True),  # read otherwise: refused
    ("^[^a]+$", False), ('^[^\\s"]+$', False), ("^[^\\x00-\\x1f\"]+$", False), ("^.+$", False),
    ("^\\S+$", False), ("^[^,]+$", False), ("^(?:x-[\\s\\S]*)$", False), ("^[a-zA-Z0-9_]{1,500}$", False),
])
def test_the_sets_llguidance_would_leak_an_escape_through(pattern, leaks):
    """llguidance quotes a set holding every control character (or all but newline) by allowing
    every JSON escape: such a set without the quote or the backslash lets `\\"` / `\\\\` through."""
    assert negation_may_exclude_an_escape(pattern) is leaks
