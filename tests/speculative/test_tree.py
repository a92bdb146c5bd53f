"""DraftTree: every derived array checked on hand-built trees with known answers."""

from __future__ import annotations

import ast
import pathlib
import random

import pytest
import torch

from prescient.kernels.reference import unpack_bits
from prescient.speculative.tree import DraftTree, pack_trees

#        0 (root, token 10)
#       / \
#      1   4        tokens 11, 14
#     / \    \
#    2   3    5     tokens 12, 13, 15
#    |
#    6              token 16
TREE = DraftTree([10, 11, 12, 13, 14, 15, 16], [-1, 0, 1, 1, 0, 4, 2])


def test_derived_arrays():
    assert TREE.num_nodes == 7 and TREE.num_draft_tokens == 6 and len(TREE) == 7
    assert TREE.depth == (0, 1, 2, 2, 1, 2, 3)
    assert TREE.max_depth == 3
    assert TREE.children == ((1, 4), (2, 3), (6,), (), (5,), (), ())
    assert TREE.first_child == (1, 2, 6, -1, 5, -1, -1)
    assert TREE.next_sibling == (-1, 4, 3, -1, -1, -1, -1)
    assert TREE.leaves == [3, 5, 6]
    assert TREE.path_to(6) == [0, 1, 2, 6]
    assert TREE.path_to(0) == [0]
    assert TREE.path_tokens(6) == [11, 12, 16]
    assert TREE.position_ids(100).tolist() == [100, 101, 102, 102, 101, 102, 103]


def test_ancestor_mask_and_bits():
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node in range(7):
        expected[node, TREE.path_to(node)] = True
    assert torch.equal(TREE.ancestor_mask, expected)
    bits = TREE.mask_bits()
    assert bits.dtype == torch.int32 and bits.shape == (7, 1)
    # node 6 attends 0, 1, 2, 6: 1 + 2 + 4 + 64
    assert int(bits[6, 0]) == 71
    assert torch.equal(unpack_bits(bits, 7), expected)
    padded = TREE.mask_bits(num_words=3)
    assert padded.shape == (7, 3) and torch.equal(padded[:, :1], bits) and not padded[:, 1:].any()
    with pytest.raises(ValueError):
        DraftTree.chain(1, range(40)).mask_bits(num_words=1)


def test_mask_bits_past_one_word():
    # A 40-deep chain: node 39 attends everything, so word 0 has bit 31 set (negative int32).
    chain = DraftTree.chain(0, list(range(1, 40)))
    bits = chain.mask_bits()
    assert bits.shape == (40, 2)
    assert int(bits[39, 0]) == -1 and int(bits[39, 1]) == 0xFF
    assert torch.equal(unpack_bits(bits, 40), torch.ones(40, 40, dtype=torch.bool).tril())


def test_masks_of_random_trees_follow_their_paths():
    """ancestor_mask and mask_bits (built from Python ints) against each node's path, for random
    trees past two words and padded."""
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 70)
        tree = DraftTree(range(n), [-1] + [rng.randrange(i) for i in range(1, n)])
        expected = torch.zeros(n, n, dtype=torch.bool)
        for node in range(n):
            expected[node, tree.path_to(node)] = True
        assert torch.equal(tree.ancestor_mask, expected)
        words = -(-n // 32) + rng.randint(0, 1)
        bits = tree.mask_bits(words)
        assert bits.shape == (n, words) and torch.equal(unpack_bits(bits, n), expected)
        assert not bits[:, -(-n // 32):].any()


def test_chain_and_single_node():
    chain = DraftTree.chain(5, [6, 7])
    assert chain.tokens == (5, 6, 7) and chain.parents == (-1, 0, 1)
    root_only = DraftTree.chain(5, [])
    assert root_only.num_nodes == 1 and root_only.depth == (0,) and root_only.leaves == [0]
    assert root_only.mask_bits().tolist() == [[1]]


def test_from_paths_merges_common_prefixes():
    tree = DraftTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5], [1, 6], [1, 2, 3]])
    assert tree.tokens == (9, 1, 2, 3, 4, 5, 6)
    assert tree.parents == (-1, 0, 1, 2, 2, 0, 1)
    assert sorted(tree.path_tokens(n) for n in tree.leaves) == [[1, 2, 3], [1, 2, 4], [1, 6], [5]]
    assert DraftTree.from_paths(9, []) == DraftTree([9], [-1])


@pytest.mark.parametrize(
    "keep, tokens, parents, kept",
    [
        # dropping node 1 drops its whole subtree (2, 3, 6)
        ([1, 0, 1, 1, 1, 1, 1], (10, 14, 15), (-1, 0, 1), [0, 4, 5]),
        # dropping a leaf only
        ([1, 1, 1, 0, 1, 1, 1], (10, 11, 12, 14, 15, 16), (-1, 0, 1, 0, 3, 2), [0, 1, 2, 4, 5, 6]),
        # the root survives even when not kept
        ([0, 0, 0, 0, 0, 0, 0], (10,), (-1,), [0]),
        ([1] * 7, TREE.tokens, TREE.parents, list(range(7))),
    ],
)
def test_truncate(keep, tokens, parents, kept):
    assert TREE.kept_nodes(keep) == kept
    out = TREE.truncate(keep)
    assert out.tokens == tokens and out.parents == parents


def test_prune():
    assert TREE.prune([2, 4]) == DraftTree([10, 11, 13], [-1, 0, 1])
    assert TREE.prune([]) == TREE


@pytest.mark.parametrize(
    "tokens, parents",
    [([], []), ([1, 2], [-1]), ([1, 2], [0, 0]), ([1, 2, 3], [-1, 2, 0]), ([1, 2], [-1, 1]), ([1, -2], [-1, 0])],
)
def test_invalid_trees_raise(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)


def test_pack_trees_pads_with_minus_one():
    draft_tokens, parents, num_nodes = pack_trees([DraftTree.chain(1, [2, 3]), DraftTree([7], [-1])])
    assert draft_tokens.tolist() == [[1, 2, 3], [7, -1, -1]]
    assert parents.tolist() == [[-1, 0, 1], [-1, -1, -1]]
    assert num_nodes.tolist() == [3, 1]


def test_tree_module_imports_nothing_of_prescient():
    source = pathlib.Path(__file__).parents[2] / "speculative" / "tree.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("prescient")
        elif isinstance(node, ast.Import):
            assert not any(alias.name.startswith("prescient") for alias in node.names)
