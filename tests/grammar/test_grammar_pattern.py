"""Schema `pattern`: compiled through the regex converter (pattern.py), checked against Python's
`re` on every short string, with JSON escapes in the string body; plus the canary showing why."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from prescient.grammar import GrammarError, GrammarSpec, spec_from_tool_choice, tools_from_request
from prescient.grammar.pattern import json_text_regex, schema_ebnf_with_patterns

from .conftest import accepts_text

DURATION = r"^-?P([0-9]+Y)?([0-9]+M)?([0-9]+D)?(T([0-9]+H)?([0-9]+M)?([0-9]+S)?)?$"


def _to_ebnf(schema_json: str) -> str:
    return str(xgr.Grammar.from_json_schema(schema_json, any_whitespace=False,
                                            strict_mode=False))


def ours(schema) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(schema_ebnf_with_patterns(schema, _to_ebnf))


def accepts(grammar: xgr.Grammar, value: str) -> bool:
    return _is_grammar_accept_string(grammar, json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize("pattern,wrongly_accepted", [
    (DURATION, "P8"), ("^(a+b)?$", "a"), ("^(a|a{0,2})$", "aaaa"), ("^(x(a+))?$", "a"),
])
def test_canary_xgrammar_pattern_fsm_over_accepts(pattern, wrongly_accepted):
    schema = {"type": "string", "pattern": pattern}
    theirs = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=False)
    assert accepts(theirs, wrongly_accepted), "xgrammar fixed its pattern FSM: pattern.py may go"
    assert not accepts(ours(schema), wrongly_accepted)


def test_duration_pattern():
    grammar = ours({"type": "string", "pattern": DURATION})
    for good in ["P1Y", "P1Y2M3DT4H5M6S", "-PT5M", "P"]:
        assert accepts(grammar, good), good
    for bad in ["P8", "P30DT5", "-P3", "1Y"]:
        assert not accepts(grammar, bad), bad


# A small ECMA-style regex generator; Python's re (ASCII classes) is the reference.
ALPHABET = ["a", "b", '"', "\\", "\n", "é"]
ATOMS = ["a", "b", '"', r"\\", r"\n", "é", "[ab]", "[^a]", ".", r"\w", r"\W", r"\s", r"\S",
         r"\d", '["a]', '[^"]', r"[\\b-c]", r"[\s\d]", r"\x61", r"\u00e9"]


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(ATOMS)
    if r < 0.55:
        return _random_regex(rng, depth + 1) + _random_regex(rng, depth + 1)
    if r < 0.7:
        return f"({_random_regex(rng, depth + 1)}|{_random_regex(rng, depth + 1)})"
    quantifier = rng.choice(["?", "+", "*", "{0,1}", "{1,2}", "{2}", "{0,2}", "??"])
    return f"({_random_regex(rng, depth + 1)}){quantifier}"


def test_random_patterns_match_python_re():
    """Every accepted string matches in both dialects (Python's `re` in Unicode mode, and in
    ASCII mode standing in for ECMA-262's ASCII \\d \\w); where the dialects read the string
    alike (ASCII), exactly the matching strings are accepted."""
    rng = random.Random(0)
    strings = ["".join(t) for n in range(4) for t in itertools.product(ALPHABET, repeat=n)]
    for _ in range(40):
        body = _random_regex(rng)
        grammar = ours({"type": "string", "pattern": f"^{body}$"})
        for s in strings:
            ascii_match = re.fullmatch(body, s, re.ASCII) is not None
            unicode_match = re.fullmatch(body, s) is not None
            if accepts(grammar, s):
                assert ascii_match and unicode_match, (body, s)
            elif s.isascii():
                assert not ascii_match, (body, s)


@pytest.mark.parametrize("pattern,text", [
    (r"^\S+@\S+$", "a\x1d@b"),  # \x1d: a space to Python's re, not to ECMA-262
    (r"^\w+$", "é"), (r"^\W$", "é"), (r"^\D$", "٣"), (r"^[^\s]$", "\x1c"), (r"^\s$", "\ufeff"),
])
def test_shorthands_take_only_what_both_dialects_agree_on(pattern, text):
    assert not accepts(ours({"type": "string", "pattern": pattern}), text)


def test_shorthands_keep_what_both_dialects_agree_on():
    grammar = ours({"type": "string", "pattern": r"^\S+@\S+\s\w\W\d\D[^\s]$"})
    assert accepts(grammar, "añ@b\u3000_-7x!")


@pytest.mark.parametrize("body", ['a"*', r"a\\?", r"\n+", r"[\\]{2}", r'["]{1,2}b', r"a\\+?"])
def test_a_quantifier_takes_the_whole_escape(body):
    """A character JSON escapes is several characters of JSON text (`\\"`): a quantifier after
    it repeats the escape, not its last character."""
    grammar = ours({"type": "string", "pattern": f"^{body}$"})
    for s in ["", "a", 'a"', 'a""', "a\\", "a\\\\", "\n", "\n\n", "\\\\", '"b', '""b', 'a\\"']:
        assert accepts(grammar, s) == (re.fullmatch(body, s) is not None), (body, s)


def test_escapes_in_the_string_body():
    grammar = ours({"type": "string", "pattern": '^a"b\\\\c\\n$'})
    assert _is_grammar_accept_string(grammar, r'"a\"b\\c\n"')
    assert not _is_grammar_accept_string(grammar, '"a"b"')


def test_patterns_inside_objects_tools_and_unused_defs(toy_compiler, toy_tokenizer):
    schema = {"type": "object", "$defs": {"unused": {"type": "string", "pattern": "^z$"}},
              "properties": {"code": {"type": "string", "pattern": "^[a-c]{2}$"},
                             "pattern": {"type": "string", "enum": ["x"]}},
              "required": ["code"]}
    grammar = toy_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert accepts_text(grammar.matcher(), toy_tokenizer, '{"code": "ab", "pattern": "x"}')
    assert not accepts_text(grammar.matcher(), toy_tokenizer, '{"code": "abc"}')
    tools = tools_from_request([{"type": "function", "function": {
        "name": "f", "parameters": schema}}])
    grammar = toy_compiler.compile(spec_from_tool_choice(tools, "required"))
    call = '<tool_call>\n{"name": "f", "arguments": {"code": "%s"}}\n</tool_call>'
    assert accepts_text(grammar.matcher(), toy_tokenizer, call % "ca")
    assert not accepts_text(grammar.matcher(), toy_tokenizer, call % "c")


@pytest.mark.parametrize("pattern,feature", [
    ("(?i)abc", "pattern:group modifier"),
    (r"\p{L}+", "pattern:'\\p' escape"),
    (r"a\b", "pattern:'\\b' escape"),
    (r"(a)\1", "pattern:'\\1' escape"),
    ("[b-a]", "pattern:character class range"),
])
def test_unsupported_regex_syntax_is_refused(pattern, feature):
    with pytest.raises(GrammarError) as info:
        json_text_regex(pattern)
    assert info.value.feature == feature
