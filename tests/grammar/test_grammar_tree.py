"""Draft-tree masks on a toy vocabulary: pruning and per-node masks against a depth-first
reference that forks the matcher, plus padding, stop tokens, in-place output and time limit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prescient.grammar import GrammarSpec, allocate_bitmask, prune_tree, tree_masks

from .conftest import TOY_STOP, TOY_VOCAB

T = {tok: i for i, tok in enumerate(TOY_VOCAB) if tok}


@pytest.fixture
def matcher(toy_compiler):
    # after "a": ("b" | "c") "a" then stop
    m = toy_compiler.compile(GrammarSpec("ebnf", 'root ::= "a" ("b" | "c") "a"')).matcher()
    assert m.accept_token(T["a"])
    return m


def reference_tree_masks(matcher, tokens, parents):
    """Depth-first over the tree, accepting each node's token on a fork and rolling back."""
    num_nodes = len(tokens)
    vocab_size = matcher.tokenizer.vocab_size
    keep = np.zeros(num_nodes, dtype=bool)
    bitmask = torch.zeros((num_nodes, (vocab_size + 31) // 32), dtype=torch.int32)
    children = [[] for _ in range(num_nodes)]
    for node in range(1, num_nodes):
        children[parents[node]].append(node)
    walker = matcher.fork()

    def visit(node):
        keep[node] = True
        if not walker.is_terminated():
            walker.fill_bitmask(bitmask, node)
        for child in children[node]:
            if tokens[child] >= 0 and walker.accept_token(tokens[child]):
                visit(child)
                walker.rollback(1)

    visit(0)
    return keep, bitmask


def test_hand_built_tree(matcher):
    # 0 (root, "a" already accepted)
    # ├── 1 "b"            valid
    # │   ├── 3 "a"        valid
    # │   │   └── 6 stop   valid
    # │   ├── 4 "b"        forbidden
    # │   └── 5 "c"        forbidden
    # └── 2 "a"            forbidden
    #     └── 7 "a"        pruned with its parent
    tokens = [T["a"], T["b"], T["a"], T["a"], T["b"], T["c"], TOY_STOP, T["a"]]
    parents = [-1, 0, 0, 1, 1, 1, 3, 2]
    result = tree_masks(matcher, tokens, parents)
    assert result.keep.tolist() == [True, True, False, True, False, False, True, False]
    keep, bitmask = reference_tree_masks(matcher, tokens, parents)
    assert np.array_equal(result.keep, keep)
    assert torch.equal(result.bitmask, bitmask)
    assert result.bitmask[6].eq(0).all()  # after the stop token nothing may follow
    assert not result.timed_out
    assert matcher.num_tokens == 1 and matcher.accept_token(T["c"])  # matcher unchanged


def test_random_trees_match_reference(toy_compiler):
    grammar = toy_compiler.compile(GrammarSpec("regex", "(ab|c)+x"))
    alphabet = [T["a"], T["b"], T["c"], T["ab"], T["x"], T["y"], TOY_STOP]
    rng = random.Random(0)
    num_pruned = 0
    for _ in range(60):
        matcher = grammar.matcher()
        matcher.accept_tokens([T["c"]] * rng.randint(0, 2))
        num_nodes = rng.randint(1, 24)
        tokens = [T["c"]] + [rng.choice(alphabet) for _ in range(num_nodes - 1)]
        parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
        result = tree_masks(matcher, tokens, parents)
        keep, bitmask = reference_tree_masks(matcher, tokens, parents)
        assert np.array_equal(result.keep, keep), (tokens, parents)
        assert torch.equal(result.bitmask, bitmask), (tokens, parents)
        num_pruned += int((~keep).sum())
    assert num_pruned > 50  # the trees did exercise pruning


def test_padding_nodes_are_pruned_and_out_is_filled_in_place(matcher, toy_tokenizer):
    tokens = [T["a"], T["b"], -1, T["a"]]
    parents = [-1, 0, 0, 1]
    batch = allocate_bitmask(6, toy_tokenizer.vocab_size)  # rows 2..5 hold this tree
    result = tree_masks(matcher, tokens, parents, out=batch[2:6])
    assert result.keep.tolist() == [True, True, False, True]
    assert result.bitmask.data_ptr() == batch[2].data_ptr()
    assert batch[4].eq(0).all()
    assert batch[0].eq(-1).all() and batch[1].eq(-1).all()


def test_prune_tree_renumbers_the_surviving_subtree():
    tokens = [10, 11, 12, 13, 14, 15]
    parents = [-1, 0, 0, 1, 2, 3]
    keep = np.array([True, True, False, True, False, True])
    node_ids, new_tokens, new_parents = prune_tree(tokens, parents, keep)
    assert node_ids.tolist() == [0, 1, 3, 5]
    assert new_tokens.tolist() == [10, 11, 13, 15]
    assert new_parents.tolist() == [-1, 0, 1, 2]


def test_time_limit_keeps_only_the_root(matcher):
    num_nodes = 4000
    tokens = [T["a"]] + [T["b"]] * (num_nodes - 1)
    parents = [-1] + [0] * (num_nodes - 1)  # a wide tree: every sibling is tried
    result = tree_masks(matcher, tokens, parents, time_limit_s=1e-6)
    assert result.timed_out
    assert result.keep.tolist() == [True] + [False] * (num_nodes - 1)
    single = allocate_bitmask(1, matcher.tokenizer.vocab_size)
    matcher.fill_bitmask(single)
    assert torch.equal(result.bitmask[0], single[0])


@pytest.mark.parametrize("tokens,parents", [
    ([], []), ([1, 2], [-1]), ([1, 2], [0, 0]), ([1, 2, 3], [-1, 2, 0]), ([1, 2], [-1, 1]),
])
def test_malformed_trees_are_rejected(matcher, tokens, parents):
    with pytest.raises(ValueError):
        tree_masks(matcher, tokens, parents)
