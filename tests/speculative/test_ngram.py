"""N-gram proposer: table-driven proposal cases, sessions, the index against brute force, cost."""

from __future__ import annotations

import random
import time

import pytest

from prescient.speculative.ngram import NgramConfig, NgramProposer, SequenceIndex
from prescient.speculative.proposer import PROPOSERS, ProposalContext, Proposer, make_proposer
from prescient.speculative.tree import DraftTree


def propose(tokens, budget, config=None, session_id=None, proposer=None, request_id="r"):
    proposer = proposer or NgramProposer(config)
    return proposer.propose([ProposalContext(request_id, session_id, tokens, budget)])[0]


CASES = [
    # (id, tokens, budget, config, expected (tokens, parents) or None)
    ("no_repeat", [1, 2, 3, 4, 5], 4, None, None),
    ("too_short", [1], 4, None, None),
    ("zero_budget", [1, 2, 3, 1, 2], 0, None, None),
    ("single_site_chain", [1, 2, 3, 4, 5, 6, 1, 2, 3], 3, None, ([3, 4, 5, 6], [-1, 0, 1, 2])),
    ("budget_truncates", [1, 2, 3, 4, 5, 6, 1, 2, 3], 2, None, ([3, 4, 5], [-1, 0, 1])),
    # 7 1 2 matches 3 tokens at the older site, 8 1 2 only 2 at the newer: longest wins
    ("longest_match_first", [7, 1, 2, 9, 10, 8, 1, 2, 5, 6, 7, 1, 2], 2, None, ([2, 9, 10], [-1, 0, 1])),
    # the shorter match gets a branch only when depth is discounted steeply
    ("depth_over_branches", [7, 1, 2, 9, 10, 8, 1, 2, 5, 6, 7, 1, 2], 3, None, ([2, 9, 10, 8], [-1, 0, 1, 2])),
    ("steep_decay_branches", [7, 1, 2, 9, 10, 8, 1, 2, 5, 6, 7, 1, 2], 3, NgramConfig(depth_decay=0.5),
     ([2, 9, 5, 10], [-1, 0, 0, 1])),
    # two sites matching 2 tokens: the newer continuation is the first child, then breadth
    ("equal_sites_branch", [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2], 4, None,
     ([2, 4, 3, 7, 6], [-1, 0, 0, 1, 2])),
    ("most_recent_first", [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2], 1, None, ([2, 4], [-1, 0])),
    # continuations sharing a prefix share nodes; the longer match owns the deeper branch
    ("shared_prefix_then_heavier", [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2], 4, None,
     ([2, 3, 4, 6, 0], [-1, 0, 1, 2, 3])),
    # a loop in the output continues past the current end (overlapping copy)
    ("repetition_loop", [5, 5, 5, 5], 5, None, ([5] * 6, [-1, 0, 1, 2, 3, 4])),
    ("period_two", [1, 2, 1, 2, 1, 2], 5, None, ([2, 1, 2, 1, 2, 1], [-1, 0, 1, 2, 3, 4])),
    ("min_match_respected", [1, 2, 9, 1, 2], 3, NgramConfig(min_match=3), None),
    ("unigram_when_allowed", [1, 9, 4, 1], 2, NgramConfig(min_match=1), ([1, 9, 4], [-1, 0, 1])),
    # max_sites=2 keeps the two newest of four equally long sites
    ("max_sites", [1, 10, 1, 11, 1, 12, 1, 13, 1], 4, NgramConfig(min_match=1, max_sites=2),
     ([1, 13, 12, 1, 1], [-1, 0, 0, 1, 2])),
]


@pytest.mark.parametrize("tokens, budget, config, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_proposal_cases(tokens, budget, config, expected):
    tree = propose(tokens, budget, config)
    if expected is None:
        assert tree is None
    else:
        assert tree == DraftTree(*expected)
        assert tree.tokens[0] == tokens[-1] and tree.num_draft_tokens <= budget


def test_session_history_is_searched_after_own_sequence():
    proposer = NgramProposer()
    tool_output = [50, 51, 52, 53, 54, 55, 56]
    propose([1, 2, 3, *tool_output], 4, session_id="s", proposer=proposer, request_id="turn1")
    proposer.on_request_finished("turn1")
    # A new turn (different prompt) starts quoting the tool output: continue from history.
    tree = propose([9, 8, 50, 51, 52], 3, session_id="s", proposer=proposer, request_id="turn2")
    assert tree == DraftTree.chain(52, [53, 54, 55])
    # Another session, or no session, does not see it.
    assert propose([9, 8, 50, 51, 52], 3, session_id="other", proposer=proposer, request_id="x") is None
    assert propose([9, 8, 50, 51, 52], 3, proposer=proposer, request_id="y") is None
    proposer.on_session_closed("s")
    assert propose([9, 8, 50, 51, 52], 3, session_id="s", proposer=proposer, request_id="turn3") is None


def test_history_ranks_by_match_length_then_after_own_sequence():
    proposer = NgramProposer()
    propose([7, 1, 2, 30, 31], 2, session_id="s", proposer=proposer, request_id="old")
    proposer.on_request_finished("old")
    # History site "7 1 2" (3 tokens) beats the own site "1 2" (2 tokens); the own site gets
    # the budget left once the history continuation ends.
    tree = propose([5, 1, 2, 40, 7, 1, 2], 3, session_id="s", proposer=proposer, request_id="a")
    assert tree == DraftTree([2, 30, 31, 40], [-1, 0, 1, 0])
    # At equal length (2 tokens each) the request's own sequence comes first.
    tree = propose([5, 1, 2, 40, 8, 1, 2], 1, session_id="s", proposer=proposer, request_id="b")
    assert tree == DraftTree([2, 40], [-1, 0])
    tree = propose([5, 1, 2, 40, 8, 1, 2], 2, session_id="s", proposer=proposer, request_id="c")
    assert tree == DraftTree([2, 40, 30], [-1, 0, 0])


def test_next_turn_adopts_previous_turn_index():
    proposer = NgramProposer()
    turn1 = [1, 2, 3, 4, 5, 6]
    propose(turn1, 2, session_id="s", proposer=proposer, request_id="t1")
    index = proposer._requests["t1"].index
    proposer.on_request_finished("t1")
    turn2 = turn1 + [7, 8, 1, 2]
    assert propose(turn2, 2, session_id="s", proposer=proposer, request_id="t2") == DraftTree.chain(2, [3, 4])
    assert proposer._requests["t2"].index is index and index.tokens == turn2
    assert proposer._sessions["s"] == []  # taken over, not duplicated


def test_next_turn_adopts_a_mostly_shared_previous_turn():
    proposer = NgramProposer()
    turn1 = [1, 2, 3, 4, 5, 6, 7, 8, 99]  # ends with a token the next prompt renders differently
    propose(turn1, 2, session_id="s", proposer=proposer, request_id="t1")
    index = proposer._requests["t1"].index
    proposer.on_request_finished("t1")
    turn2 = turn1[:-1] + [98, 1, 2]
    assert propose(turn2, 2, session_id="s", proposer=proposer, request_id="t2") == DraftTree.chain(2, [3, 4])
    assert proposer._requests["t2"].index is index and index.tokens == turn2
    proposer.on_request_finished("t2")
    # an unrelated prompt in the same session builds its own index and leaves the history be
    propose([50, 51, 52], 2, session_id="s", proposer=proposer, request_id="t3")
    assert proposer._requests["t3"].index is not index and proposer._sessions["s"] == [index]


@pytest.mark.parametrize("keep", [0, 1, 5, 150, 299, 300])
def test_truncate_restores_the_shorter_index_exactly(keep):
    rng = random.Random(keep)
    tokens = [rng.randrange(5) for _ in range(300)]
    levels = NgramConfig().levels
    grown, direct = SequenceIndex(levels, 8), SequenceIndex(levels, 8)
    grown.extend(tokens[:100])
    for t in tokens[100:]:
        grown.extend([t])
    grown.truncate(keep)
    direct.extend(tokens[:keep])
    assert grown.tokens == direct.tokens
    assert grown._heads == direct._heads and grown._prevs == direct._prevs


def test_session_history_is_bounded():
    proposer = NgramProposer(NgramConfig(max_session_tokens=10, max_sessions=2))
    for turn in range(4):
        propose([100 + turn] * 3 + [turn, turn + 1], 1, session_id="s", proposer=proposer, request_id=f"t{turn}")
        proposer.on_request_finished(f"t{turn}")
    assert [len(ix) for ix in proposer._sessions["s"]] == [5, 5]
    for sid in ("a", "b"):
        propose([1, 2, 1], 1, session_id=sid, proposer=proposer, request_id=sid)
        proposer.on_request_finished(sid)
    assert list(proposer._sessions) == ["a", "b"]


def test_incremental_appends_match_one_bulk_index():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(400)]
    stepwise, bulk = NgramProposer(), NgramProposer()
    for length in range(1, len(tokens) + 1):
        a = propose(tokens[:length], 6, proposer=stepwise)
        if length % 37 == 0 or length == len(tokens):
            assert a == propose(tokens[:length], 6, proposer=bulk, request_id=f"bulk{length}")
    proposer = NgramProposer()
    proposer.on_tokens_appended("r", None, tokens[:200])  # after prefill, before decoding
    assert propose(tokens, 6, proposer=proposer) == propose(tokens, 6, proposer=bulk, request_id="b")


def test_rewritten_history_reindexes():
    proposer = NgramProposer()
    propose([1, 2, 3, 1, 2], 2, proposer=proposer)
    assert propose([4, 5, 6, 4, 5], 2, proposer=proposer) == DraftTree.chain(5, [6, 4])


@pytest.mark.parametrize("seed", range(5))
def test_find_sites_matches_brute_force(seed):
    rng = random.Random(seed)
    config = NgramConfig(min_match=1, max_match=8, max_sites=6, max_chain=10**6)
    tokens = [rng.randrange(4) for _ in range(300)]
    index = SequenceIndex(config.levels, config.max_match)
    index.extend(tokens[:150])
    for t in tokens[150:]:
        index.extend([t])
    for suffix_len in (1, 3, 8):
        suffix = tokens[-suffix_len:]
        brute = []
        for end in range(1, len(tokens)):
            length = 0
            while length < min(8, len(suffix)) and length < end and tokens[end - length - 1] == suffix[-length - 1]:
                length += 1
            if length >= 1:
                brute.append((length, end))
        brute.sort(key=lambda s: (-s[0], -s[1]))
        assert index.find_sites(suffix, 6, config.max_chain, 1) == brute[:6]


def test_registry_and_protocol():
    assert "ngram" in PROPOSERS
    proposer = make_proposer("ngram", NgramConfig(max_sites=3))
    assert isinstance(proposer, Proposer) and proposer.config.max_sites == 3
    with pytest.raises(ValueError, match="unknown proposer"):
        make_proposer("nope")
    with pytest.raises(ValueError):
        NgramConfig(min_match=4, max_match=2)
    with pytest.raises(ValueError):
        NgramConfig(depth_decay=0.0)
    assert NgramConfig().levels == (8, 4, 2) and NgramConfig(min_match=1, max_match=6).levels == (6, 3, 1)


def _agent_context(num_tokens: int, seed: int = 0) -> list[int]:
    """A long agent context: a tool output quoted and edited several times, plus fresh text."""
    rng = random.Random(seed)
    doc = [rng.randrange(32000) for _ in range(600)]
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        if rng.random() < 0.6:
            start = rng.randrange(len(doc) - 50)
            tokens += doc[start : start + rng.randrange(20, 200)]
        else:
            tokens += [rng.randrange(32000) for _ in range(rng.randrange(5, 60))]
    return tokens[:num_tokens]


def test_propose_step_benchmark(benchmark):
    """One decode step on a 4k-token context: append the committed token, propose 8 nodes."""
    # The decoded tokens come from the same stream: they keep quoting the context's document.
    stream = _agent_context(8192)
    context, continuation = stream[:4096], stream[4096:]
    proposer = NgramProposer()
    proposer.on_tokens_appended("r", None, context)
    tokens = list(context)
    step = iter(range(10**9))

    def one_step():
        tokens.append(continuation[next(step) % len(continuation)])
        return proposer.propose([ProposalContext("r", None, tokens, 8)])[0]

    benchmark(one_step)
    # A coarse guard against regressions to per-step rescans (a 4k rescan costs milliseconds).
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            one_step()
        timings.append((time.perf_counter() - start) / 200)
    assert sorted(timings)[2] < 500e-6
