"""The n-gram ceiling replay: path matching against the true continuation, and steps counted the
way greedy verification emits tokens (accepted path + one bonus)."""

from __future__ import annotations

from prescient.latency_bench.ngram_ceiling import accepted_along, replay
from prescient.speculative.ngram import NgramConfig
from prescient.speculative.tree import DraftTree


def test_accepted_along_follows_the_matching_branch():
    tree = DraftTree.from_paths(0, [[1, 2, 9], [1, 3, 4]])
    assert accepted_along(tree, [1, 3, 4, 5]) == 3
    assert accepted_along(tree, [1, 2, 4]) == 2
    assert accepted_along(tree, [7]) == 0
    assert accepted_along(None, [1]) == 0


def test_replay_of_copied_text_takes_few_steps_and_novel_text_one_per_token():
    text = list(range(10, 40))
    steps, tokens = replay(text, text[:20], budget=8, config=NgramConfig())
    assert tokens == 19 and steps <= 4  # the output copies the prompt: 8 drafts + bonus per step
    novel = list(range(100, 120))
    steps, tokens = replay(text, novel, budget=8, config=NgramConfig())
    assert steps == tokens == 19  # nothing to copy: one token per step
