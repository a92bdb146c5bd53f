"""Compile time (issue 18): open objects' key tries rewritten and repeated rules merged, both
without changing the language; a compile past the time limit answered as a 400 naming the limit."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarError, GrammarSpec, GrammarTokenizer
from prescient.grammar.open_keys import share_key_tails
from prescient.grammar.pattern import has_pattern, schema_ebnf_with_patterns
from prescient.grammar.rule_dedupe import dedupe_rules
from prescient.latency_bench.bundled import jsonschemabench_file
from prescient.latency_bench.grammar_compliance import _WALK_STOP, _WALK_VOCAB, random_walk


def _rules(ebnf: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in ebnf.strip().splitlines())


def test_identical_rules_are_merged_and_root_keeps_its_name():
    ebnf = 'root ::= a "," b "," c\na ::= "x" | "y"\nb ::= "x" | "y"\nc ::= ("x" | "y") a\n'
    out = dedupe_rules(ebnf)
    rules = _rules(out)
    assert set(rules) == {"root", "a", "c"}
    assert rules["root"] == 'a "," a "," c'
    for text, ok in [("x,y,yx", True), ("y,x,xy", True), ("x,y,y", False), ("z,x,xx", False)]:
        assert _is_grammar_accept_string(out, text) == ok == _is_grammar_accept_string(ebnf, text), text


def test_recursive_rules_with_the_same_structure_are_merged():
    ebnf = ('root ::= a ":" b ":" c\na ::= "x" a | ""\nb ::= "x" b | ""\n'
            'c ::= "x" c | "y"\n')  # c differs in its base case: kept apart
    rules = _rules(dedupe_rules(ebnf))
    assert set(rules) == {"root", "a", "c"}
    assert _is_grammar_accept_string(dedupe_rules(ebnf), "xx::xy")
    assert not _is_grammar_accept_string(dedupe_rules(ebnf), "xx::x")


def test_rules_that_differ_only_deeper_stay_apart():
    """a and b read the same but name rules that differ (p and q, two levels down): kept apart."""
    ebnf = 'root ::= a b\na ::= "x" m\nb ::= "x" n\nm ::= "-" p\nn ::= "-" q\np ::= "1"\nq ::= "2"\n'
    out = dedupe_rules(ebnf)
    assert out == ebnf
    assert _is_grammar_accept_string(out, "x-1x-2") and not _is_grammar_accept_string(out, "x-1x-1")


def test_root_equal_to_another_rule_keeps_its_name_and_literals_are_not_references():
    ebnf = 'root ::= "a" x\nx ::= "x" [x] "root"\ny ::= "a" x\n'
    out = dedupe_rules(ebnf)
    rules = _rules(out)
    assert set(rules) == {"root", "x"}  # y (unused, same as root) folded into root
    assert rules["x"] == '"x" [x] "root"'


def test_text_in_another_layout_is_left_alone():
    for text in ['root ::= "a"\nroot ::= "b"\n', 'a ::= "x"\nb ::= "x"\n', "not a grammar"]:
        assert dedupe_rules(text) == text


def _open_object(names: list[str]) -> dict:
    return {"type": "object", "properties": {n: {"type": "string"} for n in names},
            "additionalProperties": True}


# Names whose characters need escapes in a class or literal, share prefixes, or end where another
# name goes on; "a\\h" and 'a"i' (a backslash, a quote) and "aé" take xgrammar's own form.
NAMES = ["a-b", "a]c", "a^d", "a:e", "a/f", "a[g", "a b", "ab", "a'j", "abc", "x", "xy_z", "q.r$",
         "a@", "a\\h", 'a"i', "a\u00e9"]


def _key_texts(rng: random.Random) -> list[str]:
    alphabet = list("ab-]^:/[ 'cxyz_.$@q\"\\\u00e9h")
    keys = set(NAMES) | {"", "a", "b", "abcd", "a-", "xy", "xy_", "xy_zz", "ab\\"}
    while len(keys) < 150:
        keys.add("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))))
    return [f"{{{json.dumps(k)}: {v}}}" for k in sorted(keys) for v in ("1", '"s"')]


def test_key_tries_rewritten_accept_the_same_objects():
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in NAMES},
              "additionalProperties": True}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False))
    rewritten = share_key_tails(ebnf)
    assert "prescient_key_other ::=" in rewritten  # it applied
    accepted = 0
    for text in _key_texts(random.Random(7)):
        before = _is_grammar_accept_string(ebnf, text)
        assert _is_grammar_accept_string(rewritten, text) == before, text
        accepted += before
    assert 50 < accepted < 300  # declared names with a string value are refused, the rest pass


def test_key_tries_leave_one_free_tail_per_character_instead_of_one_per_node():
    """The cost was one "any other character, then any string" class per trie node (one per
    character of the declared names); rewritten, those classes are one shared rule."""
    names = [f"{w}Expression{i}" for i, w in enumerate(["require", "disallow", "validate", "enforce"] * 5)]
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(_open_object(names)), any_whitespace=False,
                                            strict_mode=False))
    free_classes = lambda text: text.count("] basic_string_sub)")  # noqa: E731
    nodes = len({n[:i] for n in names for i in range(len(n) + 1)})  # distinct prefixes
    # one class per node, plus basic_string_sub's own; rewritten: basic_string_sub's and the shared one
    assert free_classes(ebnf) == nodes + 1
    assert free_classes(share_key_tails(ebnf)) == 2


def test_text_without_key_tries_is_unchanged():
    ebnf = str(xgr.Grammar.from_json_schema('{"type": "object", "properties": {"a": {"type": "string"}}, '
                                            '"additionalProperties": false}', any_whitespace=False))
    assert share_key_tails(ebnf) == ebnf
    assert share_key_tails("not a grammar") == "not a grammar"


def test_a_definition_used_many_times_costs_one_copy_of_its_rules(toy_compiler):
    """The slow Github_hard shape: an open object (one "any key but these" trie rule per character
    of its declared names) written in several places. Merged, five places cost what one does."""
    item = _open_object(["analytics_identifier", "api_path", "api_url", "base_path", "content_id"])

    def schema(n):
        return {"type": "object", "properties": {f"p{i}": {"type": "array", "items": item} for i in range(n)},
                "required": [f"p{i}" for i in range(n)]}

    one, five = (toy_compiler._schema_grammar(schema(n)).count("::=") for n in (1, 5))
    raw_one, raw_five = (toy_compiler._schema_ebnf(json.dumps(toy_compiler.prepare_schema(schema(n)))).count("::=")
                         for n in (1, 5))
    assert raw_five - raw_one > 4 * 40  # the trie is repeated per place without the merge ...
    assert five - one <= 4 * 3  # ... and merged, each further place adds only its own property rules


def _walker() -> GrammarCompiler:
    return GrammarCompiler(GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP]),
                           CompilerConfig(time_limit_s=60.0))


def _accepts(matcher, text: str) -> bool:
    return (all(matcher.accept_token(_WALK_VOCAB.index(c)) for c in text)
            and matcher.accept_token(_WALK_STOP) and matcher.is_terminated())


def _rewritten_samples(compiler: GrammarCompiler, each: int) -> list[tuple[str, dict, str]]:
    """(id, schema, unrewritten EBNF) for bundled sample schemas whose grammar the rewrites change:
    `each` with open objects' key tries, `each` with merged rules only."""
    tries, merged = [], []
    for name in ("Github_hard.jsonl", "Github_medium.jsonl"):
        for line in jsonschemabench_file(name).read_text().splitlines():
            row = json.loads(line)
            if len(line) > 6000:
                continue
            try:
                prepared = compiler.prepare_schema(row["schema"])
                raw = (schema_ebnf_with_patterns(prepared, compiler._schema_ebnf) if has_pattern(prepared)
                       else compiler._schema_ebnf(json.dumps(prepared)))
            except (GrammarError, RuntimeError):
                continue
            rewritten = compiler._schema_grammar(row["schema"])
            if "prescient_key_other ::=" in rewritten:
                tries.append((row["id"], row["schema"], raw))
            elif rewritten.count("::=") < raw.count("::="):
                merged.append((row["id"], row["schema"], raw))
    return tries[:each] + merged[:each]


def test_rewritten_grammars_accept_what_the_originals_do_and_only_valid_json():
    """Random walks through each grammar, on real schemas the rewrites change: every walk of the
    rewritten grammar is accepted by the unrewritten one and validates against the original
    schema; every walk of the unrewritten grammar is still accepted by the rewritten one."""
    walker = _walker()
    rng = random.Random(18)
    samples = _rewritten_samples(walker, 5)
    assert len(samples) == 10
    judged = 0
    try:
        for rid, schema, raw in samples:
            rewritten = walker.compile(GrammarSpec("json_schema", json.dumps(schema)))
            original = walker.compile(GrammarSpec("ebnf", raw))
            validator = jsonschema.validators.validator_for(schema)(schema)
            for walk_from, check in ((rewritten, original), (original, rewritten)):
                for _ in range(6):
                    text = random_walk(walk_from.matcher(), rng, 400)
                    if text is None:
                        continue
                    judged += 1
                    assert _accepts(check.matcher(), text), (rid, text)
                    assert validator.is_valid(json.loads(text)), (rid, text)
    finally:
        walker.close()
    assert judged >= 50


def test_a_compile_past_the_limit_is_a_400_naming_the_limit(real_tokenizer):
    """Through the server's constraint path: the client gets 400 invalid_grammar saying which
    limit the compile passed, not an internal error."""
    from prescient.server.constraints import Constraints
    from prescient.server.errors import APIError

    compiler = GrammarCompiler(real_tokenizer, CompilerConfig(time_limit_s=0.05))

    class Engine:
        def grammar_compiler(self, backend="xgrammar"):
            return compiler

    # a long bounded repeat of a narrow class: xgrammar builds a mask per count, 0.5-1 s on 2 cores
    slow = {"type": "string", "pattern": "^[a-z0-9]{1,300}$"}
    try:
        with pytest.raises(APIError) as err:
            asyncio.run(Constraints(Engine()).matcher(GrammarSpec("json_schema", json.dumps(slow)),
                                                      "response_format"))
        assert err.value.status == 400 and err.value.code == "invalid_grammar"
        assert err.value.message == "grammar compile exceeded the 0.05 s time limit"
        assert err.value.param == "response_format"
    finally:
        compiler.close()
