"""forced_bound.py: grammars whose forced runs could be huge get no forced-span lookups; the
others keep them, and a long forced text is cut before it is tokenized."""

from __future__ import annotations

import json
import math
import time

import pytest
import xgrammar as xgr

from prescient.grammar import GrammarSpec
from prescient.grammar.forced_bound import MAX_FORCED_RUN, forced_run_bound, forced_spans_safe
from prescient.grammar.matcher import MAX_FORCED_CHARS


def _bound(ebnf: str) -> float:
    return forced_run_bound(str(xgr.Grammar.from_ebnf(ebnf)))


def test_bounds_of_small_grammars():
    assert _bound('root ::= "abc" [x-z] "d"?') == 4  # "abcx": the shortest completion from the start
    assert _bound('root ::= "a" | "bcd"') == 3  # the longest alternative
    assert _bound('root ::= r{3, 5} "x"\nr ::= "ab"') == 3 * 2 + 1
    assert _bound('root ::= "(" root ")" | "x"') == 3  # per level of the model's own nesting
    assert _bound('root ::= "a" root s | "b"\ns ::= "c"{1000}') == math.inf  # 1000 a level: unbounded
    assert _bound('root ::= (("c"){1000}){1000}') > MAX_FORCED_RUN


def test_unreadable_text_counts_as_unbounded():
    assert not forced_spans_safe("root ::= @@@")
    assert not forced_spans_safe("no rules at all")


def test_heavy_forced_run_switches_lookups_off(real_compiler):
    heavy = real_compiler.compile(GrammarSpec("regex", "(c{1000}){1000}"))
    assert not heavy.forced_spans
    matcher = heavy.matcher()
    start = time.perf_counter()
    assert matcher.forced_tokens() == [] and matcher.draft_paths(32) == []
    assert time.perf_counter() - start < 0.05  # no million-character jump-forward
    assert matcher.fork().forced_spans is False

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    light = real_compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert light.forced_spans and light.matcher().forced_tokens()  # `{"city": "` is forced


@pytest.mark.parametrize("run", [3000, 9000])
def test_long_forced_text_is_cut_before_tokenizing(real_compiler, real_tokenizer, run):
    compiled = real_compiler.compile(GrammarSpec("regex", f"c{{{run}}}"))
    assert compiled.forced_spans  # within the bound
    forced = compiled.matcher().forced_tokens()
    text = "".join(real_tokenizer.token_texts[t] for t in forced)
    assert set(text) == {"c"} and len(text) < MAX_FORCED_CHARS  # cut, last token held back, no stop
    assert real_tokenizer.stop_token_ids[0] not in forced


def test_forced_stop_is_the_stop_only_check(real_compiler, real_tokenizer):
    matcher = real_compiler.compile(GrammarSpec("regex", "ab")).matcher()
    assert matcher.forced_stop() is None  # nothing written yet
    for token in real_tokenizer.encode("ab"):
        assert matcher.accept_token(token)
    assert matcher.forced_stop() == real_tokenizer.stop_token_ids[0]
    assert matcher.forced_tokens() == [matcher.forced_stop()]  # what the old check read
