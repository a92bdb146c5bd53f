"""Matcher: accept / rollback / termination, mask rows, batch fill, forced (jump-forward) spans."""

from __future__ import annotations

import json

import pytest
import torch

from prescient.grammar import BatchMaskFiller, GrammarSpec, allocate_bitmask

from .conftest import TOY_STOP, TOY_VOCAB


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t >> 5] >> (t & 31)) & 1}


def toy_ids(*tokens: str) -> list[int]:
    return [TOY_VOCAB.index(t) for t in tokens]


@pytest.fixture
def bool_matcher(toy_compiler):
    return toy_compiler.compile(GrammarSpec("json_schema", '{"type": "boolean"}')).matcher()


def test_mask_row_allows_exactly_the_grammar(bool_matcher, toy_tokenizer):
    vocab_size = toy_tokenizer.vocab_size
    bitmask = allocate_bitmask(2, vocab_size)
    assert bool_matcher.fill_bitmask(bitmask, 1)
    expected = {i for i, t in enumerate(TOY_VOCAB) if t and ("true".startswith(t)
                                                             or "false".startswith(t))}
    assert allowed(bitmask, 1, vocab_size) == expected
    assert allowed(bitmask, 0, vocab_size) == set(range(vocab_size))  # other row untouched


def test_accept_reject_rollback_terminate(bool_matcher):
    t, r, u, e, f = toy_ids("t", "r", "u", "e", "f")
    assert not bool_matcher.accept_token(f + 100)  # out of vocabulary
    assert bool_matcher.accept_tokens([t, r, f]) == 2  # stops at the forbidden "f"
    assert bool_matcher.num_tokens == 2
    bool_matcher.rollback(2)
    assert bool_matcher.accept_tokens(toy_ids("true")) == 1
    assert bool_matcher.is_completed() and not bool_matcher.is_terminated()
    assert not bool_matcher.accept_token(e)
    assert bool_matcher.accept_token(TOY_STOP)
    assert bool_matcher.is_terminated()
    assert not bool_matcher.accept_token(t)
    bool_matcher.rollback(1)  # undo the stop token (a rejected speculative step)
    assert not bool_matcher.is_terminated()
    with pytest.raises(ValueError):
        bool_matcher.rollback(5)


def test_special_tokens_never_allowed(toy_compiler, toy_tokenizer):
    matcher = toy_compiler.compile(GrammarSpec("json_schema", '{"type": "string"}')).matcher()
    assert matcher.accept_token(TOY_VOCAB.index('"'))
    bitmask = allocate_bitmask(1, toy_tokenizer.vocab_size)
    matcher.fill_bitmask(bitmask)
    mask = allowed(bitmask, 0, toy_tokenizer.vocab_size)
    assert 0 not in mask and TOY_STOP not in mask
    assert TOY_VOCAB.index("x") in mask


def test_real_tokenizer_control_tokens_stay_out_of_strings(real_compiler, real_tokenizer,
                                                           hf_tokenizer):
    matcher = real_compiler.compile(GrammarSpec("json_schema", '{"type": "string"}')).matcher()
    matcher.accept_tokens(real_tokenizer.encode('"abc'))
    bitmask = allocate_bitmask(1, real_tokenizer.vocab_size)
    matcher.fill_bitmask(bitmask)
    mask = allowed(bitmask, 0, real_tokenizer.vocab_size)
    assert not set(hf_tokenizer.all_special_ids) & mask
    assert real_tokenizer.encode(" def")[0] in mask


def test_batch_fill_matches_single_fill(toy_compiler, toy_tokenizer):
    grammar = toy_compiler.compile(GrammarSpec(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
    matchers = [grammar.matcher() for _ in range(3)]
    matchers[1].accept_tokens(toy_tokenizer.encode('{"a": 1'))
    matchers[2].accept_tokens(toy_tokenizer.encode("{"))
    vocab_size = toy_tokenizer.vocab_size
    single = allocate_bitmask(1, vocab_size)
    for min_rows_for_threads in (1, 128):  # xgrammar's thread pool, then the plain loop
        batch = allocate_bitmask(4, vocab_size)
        filler = BatchMaskFiller(max_threads=2, min_rows_for_threads=min_rows_for_threads)
        filler.fill(matchers, batch, rows=[3, 0, 2])
        for matcher, row in zip(matchers, [3, 0, 2]):
            matcher.fill_bitmask(single, 0)
            assert torch.equal(batch[row], single[0])
        assert allowed(batch, 1, vocab_size) == set(range(vocab_size))


FIXED_KEYS = {
    "type": "object",
    "properties": {"location": {"type": "string"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
    "additionalProperties": False,
}


def test_forced_span_is_canonical_minus_its_last_token(real_compiler, real_tokenizer):
    matcher = real_compiler.compile(GrammarSpec("json_schema", json.dumps(FIXED_KEYS))).matcher()
    assert matcher.handle.find_jump_forward_string() == '{"location": "'
    forced = matcher.forced_tokens()
    canonical = real_tokenizer.encode('{"location": "')
    assert forced == canonical[:-1]  # ` "` is held back: it could merge with what follows
    assert matcher.num_tokens == 0  # asking does not advance the matcher
    assert matcher.accept_tokens(forced) == len(forced)
    # After the string value, the next key is forced up to its value.
    value = real_tokenizer.encode(' "Paris"')
    matcher.accept_tokens(value)
    assert real_tokenizer.encode(', "unit": "')[:-1] == matcher.forced_tokens()
    matcher.rollback(len(value) + len(forced))  # the cached span follows the state back
    assert matcher.forced_tokens() == forced


def test_the_span_encoder_is_the_tokenizers_and_hands_out_its_own_lists(real_tokenizer, hf_tokenizer):
    """GrammarTokenizer.encode remembers texts it has tokenized (forced spans repeat): each call
    still gives the model tokenizer's ids, in a list of its own that a caller may change."""
    for text in ('", "unit": "', '{"location": "', "", " Paris", '"}'):
        first = real_tokenizer.encode(text)
        assert first == list(hf_tokenizer.encode(text, add_special_tokens=False))
        first.append(-1)
        assert real_tokenizer.encode(text) == list(hf_tokenizer.encode(text, add_special_tokens=False))


def test_no_forced_tokens_at_a_choice_or_after_termination(toy_compiler, toy_tokenizer):
    grammar = toy_compiler.compile(GrammarSpec("regex", "a(b|c)"))
    matcher = grammar.matcher()
    assert matcher.forced_tokens() == []  # "a" is a single token: nothing left after holding back
    matcher.accept_tokens(toy_ids("a"))
    assert matcher.forced_tokens() == []  # b or c: a choice
    matcher.accept_tokens(toy_ids("b") + [TOY_STOP])
    assert matcher.is_terminated() and matcher.forced_tokens() == []


def test_span_that_reaches_the_end_keeps_its_last_token_and_forces_the_stop(toy_compiler):
    matcher = toy_compiler.compile(GrammarSpec("regex", "a(b|c)xy")).matcher()
    matcher.accept_tokens(toy_ids("a", "b"))
    # nothing can follow "xy", so no byte merge to fear: the whole span, then the stop token
    assert matcher.forced_tokens() == toy_ids("x", "y") + [TOY_STOP]
    matcher.accept_tokens(toy_ids("x", "y"))
    assert matcher.forced_tokens() == [TOY_STOP]
    # where the grammar may go on (another "x"), the stop token is a choice, not forced
    loose = toy_compiler.compile(GrammarSpec("regex", "ax*")).matcher()
    loose.accept_tokens(toy_ids("a"))
    assert loose.forced_tokens() == []


def test_fork_is_independent(bool_matcher):
    twin = bool_matcher.fork()
    assert twin.accept_tokens(toy_ids("f", "a")) == 2
    assert bool_matcher.num_tokens == 0
    assert bool_matcher.accept_token(toy_ids("t")[0])


def test_draft_paths_branch_at_a_narrow_choice(toy_compiler):
    matcher = toy_compiler.compile(GrammarSpec("regex", "a(bxy|cz)")).matcher()
    matcher.accept_tokens(toy_ids("a"))
    paths = matcher.draft_paths(budget=16, branch_budget=8)
    # b and c are the only choices; each forces the rest up to the stop token
    assert sorted(paths) == sorted([toy_ids("b", "x", "y") + [TOY_STOP], toy_ids("c", "z") + [TOY_STOP]])
    # a tight budget keeps every choice, then the shortest forced tails first
    assert sorted(matcher.draft_paths(budget=3, branch_budget=8)) == sorted([toy_ids("b"), toy_ids("c", "z")])
    assert sorted(matcher.draft_paths(budget=5, branch_budget=8)) == sorted([toy_ids("b", "x"), toy_ids("c", "z") + [TOY_STOP]])
    assert matcher.draft_paths(budget=16, branch_budget=2) == [toy_ids("b"), toy_ids("c")]
    assert matcher.draft_paths(budget=1, branch_budget=8) == []  # not even one token per choice
    assert matcher.num_tokens == 1  # asking does not advance the matcher
    # a wide choice (any letter, repeated) gives no branches
    wide = toy_compiler.compile(GrammarSpec("regex", "a[a-z]+")).matcher()
    wide.accept_tokens(toy_ids("a"))
    assert wide.draft_paths(budget=16, branch_budget=8) == []
    # choices nest: after "a", b or c; after "ab", x or y, each forcing the rest
    nested = toy_compiler.compile(GrammarSpec("regex", "a(b(xz|yz)|c)")).matcher()
    nested.accept_tokens(toy_ids("a"))
    assert sorted(nested.draft_paths(budget=16, branch_budget=16)) == sorted([
        toy_ids("b", "x", "z") + [TOY_STOP], toy_ids("b", "y", "z") + [TOY_STOP], toy_ids("c") + [TOY_STOP]])
