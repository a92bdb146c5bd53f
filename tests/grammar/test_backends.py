"""Both grammar backends (CompilerConfig.backend) behind one Matcher interface: the same
accept / reject / rollback / termination, masks that agree with what the matcher accepts, tree
masks, forced spans and draft paths, batch fills; what "llguidance" refuses by name and what
"auto" picks; random walks through llguidance's grammars that jsonschema judges valid."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from prescient.grammar import (
    BatchMaskFiller,
    CompilerConfig,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarTokenizer,
    allocate_bitmask,
    tree_masks,
)

from .conftest import TOY_STOP, TOY_VOCAB, accepts_text
from .test_grammar_tree import reference_tree_masks

pytest.importorskip("llguidance")

T = {tok: i for i, tok in enumerate(TOY_VOCAB) if tok}
BACKENDS = ("xgrammar", "llguidance")

WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def ids(*tokens: str) -> list[int]:
    return [T[t] for t in tokens]


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t >> 5] >> (t & 31)) & 1}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def compiler(toy_tokenizer, backend):
    c = GrammarCompiler(toy_tokenizer, CompilerConfig(time_limit_s=30.0, backend=backend))
    yield c
    c.close()


@pytest.fixture(scope="module")
def real(real_tokenizer, backend):
    c = GrammarCompiler(real_tokenizer, CompilerConfig(time_limit_s=30.0, backend=backend))
    yield c
    c.close()


def compile_(compiler, kind: str, source) -> object:
    grammar = compiler.compile(GrammarSpec(kind, source if isinstance(source, str) else json.dumps(source)))
    assert grammar.backend == compiler.config.backend  # the backend asked for compiled it
    return grammar


# --- the matcher contract ---------------------------------------------------------------------


def test_accept_reject_rollback_terminate(compiler):
    m = compile_(compiler, "json_schema", {"type": "boolean"}).matcher()
    assert not m.accept_token(len(TOY_VOCAB) + 5)  # out of vocabulary
    assert m.accept_tokens(ids("t", "r", "f")) == 2  # stops at the forbidden "f", state kept
    assert m.num_tokens == 2 and not m.is_completed()
    m.rollback(2)
    assert m.accept_tokens(ids("true")) == 1
    assert m.is_completed() and not m.is_terminated()
    assert not m.accept_token(T["e"])
    assert m.accept_token(TOY_STOP) and m.is_terminated()
    assert not m.accept_token(T["t"])  # nothing after the stop token
    m.rollback(1)  # a rejected speculative stop
    assert not m.is_terminated() and m.is_completed()
    m.rollback(1)
    assert m.num_tokens == 0 and not m.is_completed()
    assert m.accept_tokens(ids("f", "a", "l", "s", "e")) == 5 and m.accept_token(TOY_STOP)
    with pytest.raises(ValueError):
        m.rollback(7)


def test_a_stop_token_is_refused_before_the_grammar_is_complete(compiler):
    m = compile_(compiler, "json_schema", {"type": "boolean"}).matcher()
    assert not m.accept_token(TOY_STOP)
    assert m.accept_tokens(ids("t", "r")) == 2 and not m.accept_token(TOY_STOP)


def test_mask_is_exactly_the_grammar_at_a_choice(compiler, toy_tokenizer):
    m = compile_(compiler, "json_schema", {"type": "boolean"}).matcher()
    bitmask = allocate_bitmask(2, toy_tokenizer.vocab_size)
    m.fill_bitmask(bitmask, 1)
    expected = {i for i, t in enumerate(TOY_VOCAB) if t and ("true".startswith(t) or "false".startswith(t))}
    assert allowed(bitmask, 1, toy_tokenizer.vocab_size) == expected
    assert allowed(bitmask, 0, toy_tokenizer.vocab_size) == set(range(toy_tokenizer.vocab_size))  # untouched
    m.accept_tokens(ids("true"))
    m.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0, toy_tokenizer.vocab_size) == {TOY_STOP}  # only the end


def test_every_masked_token_is_accepted_along_a_walk(compiler, toy_tokenizer):
    """The mask never allows a token the matcher would refuse. (llguidance allows only the
    canonical tokenization where the grammar forces the text, a token-level narrowing, so the
    converse holds for xgrammar and, on llguidance, at choices.)"""
    vocab = toy_tokenizer.vocab_size
    m = compile_(compiler, "json_schema", {"type": "object", "properties": {"a": {"type": "array",
                 "items": {"type": "integer"}}, "b": {"type": "boolean"}}, "required": ["a"]}).matcher()
    text = '{"a": [12, 3], "b": true}'
    bitmask = allocate_bitmask(1, vocab)
    for token in toy_tokenizer.encode(text) + [TOY_STOP]:
        m.fill_bitmask(bitmask, 0)
        mask = allowed(bitmask, 0, vocab)
        accepted = set()
        for t in range(vocab):
            probe = m.fork()
            if probe.accept_token(t):
                accepted.add(t)
        assert mask <= accepted
        if compiler.config.backend == "xgrammar":
            assert mask == accepted
        assert token in mask
        assert m.accept_token(token)
    assert m.is_terminated()


def test_special_tokens_never_allowed(compiler, toy_tokenizer):
    m = compile_(compiler, "json_schema", {"type": "string"}).matcher()
    assert m.accept_token(T['"'])
    bitmask = allocate_bitmask(1, toy_tokenizer.vocab_size)
    m.fill_bitmask(bitmask, 0)
    assert 0 not in allowed(bitmask, 0, toy_tokenizer.vocab_size)  # the blank (special) token
    assert not m.accept_token(0)


def test_declared_objects_are_closed_on_both(compiler, toy_tokenizer):
    """Both compile prescient's prepared schema: undeclared keys are refused alike."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    m = compile_(compiler, "json_schema", schema).matcher()
    assert m.accept_tokens(toy_tokenizer.encode('{"a": 1}') + [TOY_STOP]) == len(toy_tokenizer.encode('{"a": 1}')) + 1
    m = compile_(compiler, "json_schema", schema).matcher()
    text = toy_tokenizer.encode('{"b": 1}')
    assert m.accept_tokens(text) < len(text)


def test_fork_is_independent(compiler):
    m = compile_(compiler, "json_schema", {"type": "boolean"}).matcher()
    twin = m.fork()
    assert type(twin) is type(m)
    assert twin.accept_tokens(ids("f", "a")) == 2
    assert m.num_tokens == 0 and m.accept_token(T["t"])
    assert twin.accept_token(T["l"]) and not twin.accept_token(T["t"])


def test_regex(compiler):
    m = compile_(compiler, "regex", "a(b|c)x").matcher()
    assert m.accept_tokens(ids("a", "c", "x")) == 3 and m.accept_token(TOY_STOP)
    m = compile_(compiler, "regex", r"\d+").matcher()  # ASCII digits, as xgrammar reads \d
    assert m.accept_tokens(ids("1", "2")) == 2 and not m.accept_token(T["a"])


# --- tree masks, forced spans, draft paths, batch fills ---------------------------------------


def test_tree_masks_match_a_depth_first_reference(compiler):
    grammar = compile_(compiler, "regex", "(ab|c)+x")
    alphabet = [T["a"], T["b"], T["c"], T["ab"], T["x"], T["y"], TOY_STOP]
    rng = random.Random(0)
    pruned = 0
    for _ in range(40):
        m = grammar.matcher()
        m.accept_tokens([T["c"]] * rng.randint(0, 2))
        before = m.num_tokens
        n = rng.randint(1, 20)
        tokens = [T["c"]] + [rng.choice(alphabet) for _ in range(n - 1)]
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        result = tree_masks(m, tokens, parents)
        keep, bitmask = reference_tree_masks(m, tokens, parents)
        assert np.array_equal(result.keep, keep), (tokens, parents)
        assert torch.equal(result.bitmask, bitmask), (tokens, parents)
        assert m.num_tokens == before  # the traversal leaves the matcher as it was
        pruned += int((~keep).sum())
    assert pruned > 30


def test_tree_masks_zero_the_row_after_a_stop(compiler):
    m = compile_(compiler, "regex", "ab").matcher()
    m.accept_token(T["a"])
    result = tree_masks(m, [T["a"], T["b"], TOY_STOP, T["b"]], [-1, 0, 1, 0])
    assert result.keep.tolist() == [True, True, True, True]
    assert result.bitmask[2].eq(0).all()
    assert m.accept_token(T["b"])  # unchanged


def test_forced_span_is_canonical_minus_its_last_token(real, real_tokenizer):
    m = compile_(real, "json_schema", WEATHER).matcher()
    assert m.handle.find_jump_forward_string() == '{"location": "'
    forced = m.forced_tokens()
    assert forced == real_tokenizer.encode('{"location": "')[:-1]
    assert m.num_tokens == 0
    assert m.accept_tokens(forced) == len(forced)
    value = real_tokenizer.encode(' "Paris"')
    assert m.accept_tokens(value) == len(value)
    assert m.forced_tokens() == real_tokenizer.encode(', "unit": "')[:-1]
    m.rollback(len(value) + len(forced))
    assert m.forced_tokens() == forced


def test_span_to_the_end_forces_the_stop(compiler):
    m = compile_(compiler, "regex", "a(b|c)xy").matcher()
    assert m.forced_tokens() == []  # "a", held back
    m.accept_tokens(ids("a"))
    assert m.forced_tokens() == []  # a choice
    m.accept_tokens(ids("b"))
    assert m.forced_tokens() == ids("x", "y") + [TOY_STOP]
    m.accept_tokens(ids("x", "y"))
    assert m.forced_stop() == TOY_STOP
    m.accept_token(TOY_STOP)
    assert m.forced_tokens() == [] and m.forced_stop() is None


def test_draft_paths_branch_at_a_narrow_choice(compiler):
    m = compile_(compiler, "regex", "a(bxy|cz)").matcher()
    m.accept_tokens(ids("a"))
    paths = m.draft_paths(budget=16, branch_budget=8)
    assert sorted(paths) == sorted([ids("b", "x", "y") + [TOY_STOP], ids("c", "z") + [TOY_STOP]])
    assert m.num_tokens == 1


def test_batch_fill_with_both_kinds_of_matcher(toy_tokenizer):
    """One batch may hold matchers of both backends (auto): each row as its own fill gives it."""
    vocab = toy_tokenizer.vocab_size
    matchers = []
    for backend in BACKENDS:
        c = GrammarCompiler(toy_tokenizer, CompilerConfig(backend=backend))
        for source in ('{"type": "boolean"}', '{"type": "integer"}'):
            matchers.append(c.compile(GrammarSpec("json_schema", source)).matcher())
        c.close()
    matchers[1].accept_token(T["1"])
    matchers[3].accept_token(T["1"])
    single = allocate_bitmask(len(matchers), vocab)
    for row, m in enumerate(matchers):
        m.fill_bitmask(single, row)
    for threads_from in (1, 128):
        batch = allocate_bitmask(len(matchers) + 1, vocab)
        BatchMaskFiller(min_rows_for_threads=threads_from).fill(matchers, batch, rows=[4, 3, 2, 1])
        assert torch.equal(batch[[4, 3, 2, 1]], single)
        assert batch[0].eq(-1).all()
    assert torch.equal(single[0], single[2]) and torch.equal(single[1], single[3])  # backends agree


# --- what each mode compiles with -------------------------------------------------------------


# llguidance's strict mode has no propertyNames, and prescient rewrites it only where it is a
# pattern alone (llg_schema.py): a schema only xgrammar's path enforces
ONLY_KEY_A = {"type": "object", "propertyNames": {"enum": ["a"]}}


def test_llguidance_refuses_what_it_cannot_enforce_exactly(toy_tokenizer):
    c = GrammarCompiler(toy_tokenizer, CompilerConfig(backend="llguidance"))
    try:
        for spec in (GrammarSpec("json_schema", json.dumps(ONLY_KEY_A)),
                     GrammarSpec("ebnf", 'root ::= "a"'),
                     GrammarSpec("tool_calls", json.dumps([{"name": "f", "parameters": {"type": "object"}}]))):
            with pytest.raises(GrammarError, match="llguidance") as err:
                c.compile(spec)
            assert err.value.feature == "llguidance"
    finally:
        c.close()


def test_both_get_prescients_lowering(toy_tokenizer):
    """Keywords llguidance alone refuses (uniqueItems, not, dependentRequired) reach it already
    lowered into plain ones, so it serves them, with the same outputs allowed as xgrammar."""
    c = GrammarCompiler(toy_tokenizer, CompilerConfig(backend="llguidance"))
    try:
        unique = c.compile(GrammarSpec("json_schema", json.dumps(
            {"type": "array", "uniqueItems": True, "items": {"enum": [1, 2]}})))
        for text, ok in (("[1, 2]", True), ("[2]", True), ("[1, 1]", False)):
            m = unique.matcher()
            tokens = toy_tokenizer.encode(text)
            assert (m.accept_tokens(tokens) == len(tokens) and m.accept_token(TOY_STOP)) == ok, text
    finally:
        c.close()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError):
        CompilerConfig(backend="outlines")


@pytest.fixture(scope="module")
def auto(toy_tokenizer):
    c = GrammarCompiler(toy_tokenizer, CompilerConfig(time_limit_s=30.0, backend="auto"))
    yield c
    c.close()


def test_auto_takes_llguidance_for_a_plain_schema(auto):
    assert auto.compile(GrammarSpec("json_schema", json.dumps(WEATHER))).backend == "llguidance"
    assert auto.compile(GrammarSpec("json_object", "")).backend == "llguidance"


def test_auto_falls_back_to_xgrammar_where_llguidance_refuses(auto, toy_tokenizer):
    grammar = auto.compile(GrammarSpec("json_schema", json.dumps(ONLY_KEY_A)))
    assert grammar.backend == "xgrammar"
    m = grammar.matcher()
    text = toy_tokenizer.encode('{"a": 1}')
    assert m.accept_tokens(text) == len(text) and m.accept_token(TOY_STOP)
    m = grammar.matcher()
    text = toy_tokenizer.encode('{"b": 1}')
    assert m.accept_tokens(text) < len(text)


def test_auto_keeps_xgrammar_for_its_own_dialects(auto):
    assert auto.compile(GrammarSpec("ebnf", 'root ::= "a"')).backend == "xgrammar"
    assert auto.compile(GrammarSpec("regex", "ab")).backend == "xgrammar"


def test_auto_reports_xgrammars_refusal_when_both_refuse(auto):
    with pytest.raises(GrammarError):
        auto.compile(GrammarSpec("ebnf", "root ::= ("))


# --- random walks through llguidance's grammar, judged by jsonschema --------------------------

WALK_SCHEMAS = [
    WEATHER,
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 50},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 3}},
     "required": ["n"]},
    {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "null"}]}},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                      "kind": {"const": "x"}}, "required": ["id", "kind"]},
]


@pytest.mark.parametrize("schema", WALK_SCHEMAS, ids=range(len(WALK_SCHEMAS)))
def test_llguidance_walks_are_valid_json(schema):
    jsonschema = pytest.importorskip("jsonschema")
    from prescient.latency_bench.grammar_compliance import _WALK_STOP, _WALK_VOCAB, random_walk

    chars = GrammarTokenizer.from_vocab(_WALK_VOCAB, stop_token_ids=[_WALK_STOP])
    c = GrammarCompiler(chars, CompilerConfig(backend="llguidance"))
    try:
        grammar = c.compile(GrammarSpec("json_schema", json.dumps(schema)))
    finally:
        c.close()
    rng = random.Random(1)
    finished = 0
    for _ in range(12):
        text = random_walk(grammar.matcher(), rng, 300)
        if text is None:
            continue
        finished += 1
        jsonschema.validate(json.loads(text), schema)
    assert finished >= 3


def test_auto_with_workers_serves_llguidance_first_then_xgrammar(real_tokenizer, tmp_path, monkeypatch):
    """A new schema waits for llguidance's compile only; once it recurs xgrammar compiles it in a
    worker and serves the later requests (cheaper masks), and after a restart the disk's xgrammar
    compile serves the first request at once. A schema met once costs no xgrammar compile."""
    import time

    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    config = CompilerConfig(isolate=True, max_workers=1, time_limit_s=60, disk_cache_mb=16, backend="auto")
    spec = GrammarSpec("json_schema", json.dumps(WEATHER))
    text = '{"location": "Paris", "unit": "celsius"}'
    c = GrammarCompiler(real_tokenizer, config)
    try:
        first = c.compile(spec)
        assert first.backend == "llguidance"
        assert spec not in c._upgrading  # nothing more for a schema met once
        deadline = time.monotonic() + 120  # a worker's start (~3 s) and the compile
        later = c.compile(spec)
        while later.backend != "xgrammar" and time.monotonic() < deadline:
            time.sleep(0.1)
            later = c.compile(spec)
        assert later.backend == "xgrammar"
        for grammar in (first, later):  # the matcher made before the switch keeps working
            assert accepts_text(grammar.matcher(), real_tokenizer, text)
            assert not accepts_text(grammar.matcher(), real_tokenizer, '{"location": 1}')
    finally:
        c.close()
    again = GrammarCompiler(real_tokenizer, config)  # a restart
    try:
        assert again.compile(spec).backend == "xgrammar"
    finally:
        again.close()
