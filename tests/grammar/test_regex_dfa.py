"""grammar/regex/dfa.py: a pattern with nested repetition becomes a minimal-DFA grammar that
matches the same JSON string bodies as the pattern (and as xgrammar's own form of it), in time
per token that does not grow with the string."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from prescient.grammar import GrammarSpec
from prescient.grammar.pattern import json_text_regex
from prescient.grammar.regex.dfa import dfa_ebnf

URL = r"^(https?:\/\/)?([\da-z\.-]+)\.([a-z\.]{2,6})([\/\w \.-]*)*\/?$"  # jsonschemabench o82851
NESTED = [
    URL,
    r"(\w+\s?)*",
    r"^(?:\S+\s+){0,3}\S+$",
    r"^([a-z ]+)*$",
    r"(a{2,3})*b",
    r'^("[^"]*")*$',
    r"^((ab|a)?c*)+$",
    r"^$|(^(?:\S+\s+){0,2}\S+$)",
    r"([^\\]+\\?)*",
    r"(?:(?:\.[^,\s]|[^,\.\s\*])[^,\s]*)(?:,\s*(?:\.[^,\s]|[^,\.\s\*])[^,\s]*)*",
]
# ASCII only, no \r and none of \x1c-\x1f: where Python's `re` reads \s, \w and `.` as
# grammar/pattern.py does (ECMA-262)
ALPHABET = 'ab c.-/:"\\\n\t,*_9hxtps'


def _body(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@pytest.mark.parametrize("pattern", NESTED)
def test_dfa_matches_what_the_pattern_matches(pattern):
    ebnf = dfa_ebnf(pattern)
    assert ebnf is not None
    dfa = xgr.Grammar.from_ebnf(ebnf)
    reference = xgr.Grammar.from_regex(json_text_regex(pattern))  # xgrammar's form of it
    whole = re.compile(pattern, re.ASCII)  # fullmatch: anchors at the ends are no-ops
    rng = random.Random(pattern)
    strings = {"", "a", "ab", "a b", "a.bc", "http://x.co/a b", "x.co/a.b/", "aab", "aaab", '"a"', '"a""b"',
               "a\\", "a\\b\\"}
    while len(strings) < 400:
        strings.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 9))))
    matched = 0
    for text in sorted(strings):
        expected = whole.fullmatch(text) is not None
        matched += expected
        assert accepts(dfa, _body(text)) == expected, (pattern, text)
        assert accepts(reference, _body(text)) == expected, (pattern, text)
    assert matched >= 3  # the sample reaches the pattern's language, not only its complement


def test_minimal_states():
    assert dfa_ebnf(r"(a+|aa)*").splitlines() == ['root ::= ([a] root | "")']  # a*: one state
    # \S+ (\s+ \S+){0,2}: start, in word / in space for each of three words, minus the last space
    rules = [ln for ln in dfa_ebnf(r"^(?:\S+\s+){0,2}\S+$").splitlines() if not ln.startswith("e")]
    assert len(rules) == 6


def test_patterns_without_nested_repetition_keep_xgrammars_form():
    for pattern in (r"^[a-z]+$", r"^(ab|cd)*$", r"^\d{3}-\d{4}$", r"(https?://)?[a-z]+"):
        assert dfa_ebnf(pattern) is None


def test_past_the_caps_or_unreadable_falls_back():
    assert dfa_ebnf(r"(?:a+b){0,5000}") is None  # 10,000 positions
    assert dfa_ebnf(r"^(a*($|/))*$") is None  # '$' inside a repeat: not a whole-string no-op


def test_schema_compile_uses_the_dfa_and_stays_cheap_per_token(real_compiler, real_tokenizer, hf_tokenizer):
    schema = {"type": "string", "pattern": URL}
    ebnf = real_compiler._schema_grammar(schema)
    assert "prescient_pattern_0_s1 ::=" in ebnf  # one rule per DFA state
    compiled = real_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    text = '"mywebsite.com/' + "myblog/mybloggeriminexpirineminexmimeneminex " * 8 + '"'
    matcher = compiled.matcher()
    bitmask = xgr.allocate_token_bitmask(1, real_tokenizer.info.vocab_size)
    start = time.monotonic()
    for token_id in hf_tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(bitmask)
        assert matcher.accept_token(token_id)
    # liveness, not speed: xgrammar's form of this pattern took 4 s for the first 51 tokens
    # (0.27 s a token by then, and growing); the DFA takes ~0.1 ms a token
    assert time.monotonic() - start < 5.0
    assert matcher.accept_token(real_tokenizer.stop_token_ids[0])


@pytest.mark.parametrize("pattern", [
    r"(){0,100000000}",  # a repeat of nothing, counted past the caps: no loop that long
    r"(?:\W+\s+){0,99}\W+",  # ~700 ranges a position: the work cap, not seconds of it
    r"(a*b){3,2}",  # bounds out of order: an error for every reader, so not a grammar here
    "(a*b){\u0663}",  # an Arabic-Indic 3 is not a count to ECMA-262 or Python's re
    r"(a*)*[^\s\S]",  # matches nothing
])
def test_unusual_patterns_fall_back_quickly(pattern):
    start = time.monotonic()
    assert dfa_ebnf(pattern) is None
    assert time.monotonic() - start < 3.0  # liveness: the work cap is ~0.3 s


def test_dead_branches_leave_no_dangling_rules():
    ebnf = dfa_ebnf(r"(a*)*(b[^\s\S])?")  # the optional branch can never complete
    assert ebnf.splitlines() == ['root ::= ([a] root | "")']
    xgr.Grammar.from_ebnf(ebnf)
