"""Grammar masks for a draft tree: prune what the grammar forbids, mask what may follow.

Input is the plain tree of the speculative layer (no prescient type): `tokens [N]`,
`parents [N]`, node 0 the root (the last verified token, already accepted by the matcher,
parent -1), `parents[i] < i`; a token of -1 marks a padding node. Output:

- `keep [N]` bool: the grammar-valid subtree. A node survives iff its parent survives and its
  token is allowed after its parent's path. Pruning happens before verification so the target
  never spends compute on (or accepts) a token the grammar forbids.
- `bitmask [N, ceil(vocab_size / 32)]` int32: row n allows the tokens that may follow node n's
  path; this masks the target's logits at node n. Rows of pruned nodes are zero, and so is the
  row of a node whose token is a stop token (nothing may follow it).

The traversal is xgrammar's own (`GrammarMatcher.traverse_draft_tree`: depth-first, accepting
each node's token and rolling back after its subtree), which leaves the matcher unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from prescient.grammar.matcher import Matcher, allocate_bitmask


@dataclass(frozen=True)
class TreeMasks:
    keep: np.ndarray  # [N] bool
    bitmask: torch.Tensor  # [N, ceil(vocab_size / 32)] int32
    timed_out: bool  # traversal hit the time limit: only the root is kept


def tree_masks(
    matcher: Matcher,
    tokens: Sequence[int] | np.ndarray | torch.Tensor,
    parents: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    time_limit_s: float | None = None,
) -> TreeMasks:
    """`out`, if given, is an [N, W] int32 CPU tensor to fill in place (e.g. a contiguous slice
    of the batch bitmask holding this request's tree rows)."""
    tokens_np = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [N]
    parents_np = np.asarray(parents, dtype=np.int64).reshape(-1)  # [N]
    num_nodes = len(tokens_np)
    _check_tree(tokens_np, parents_np)
    vocab_size = matcher.tokenizer.vocab_size
    bitmask = allocate_bitmask(num_nodes, vocab_size) if out is None else out
    if tuple(bitmask.shape) != (num_nodes, (vocab_size + 31) // 32):
        raise ValueError(f"out has shape {tuple(bitmask.shape)}, expected "
                         f"({num_nodes}, {(vocab_size + 31) // 32})")

    # First-child / next-sibling links over real (non-padding) nodes, children in index order.
    first_child = np.full(num_nodes, -1, dtype=np.int64)
    next_sibling = np.full(num_nodes, -1, dtype=np.int64)
    for node in range(num_nodes - 1, 0, -1):
        if 0 <= tokens_np[node] < vocab_size:
            parent = parents_np[node]
            next_sibling[node] = first_child[parent]
            first_child[parent] = node

    completed = matcher.handle.traverse_draft_tree(
        torch.from_numpy(first_child), torch.from_numpy(next_sibling),
        torch.from_numpy(tokens_np.clip(min=0)), bitmask,
        -1.0 if time_limit_s is None else time_limit_s,
    )
    keep = np.zeros(num_nodes, dtype=bool)
    if not completed:
        keep[0] = True
        bitmask.numpy()[1:] = 0
        matcher.fill_bitmask(bitmask, 0)
        return TreeMasks(keep, bitmask, timed_out=True)

    words = bitmask.numpy()  # [N, W], shares memory
    keep[0] = True
    for node in range(1, num_nodes):
        token, parent = tokens_np[node], parents_np[node]
        keep[node] = (
            keep[parent]
            and 0 <= token < vocab_size
            and bool((int(words[parent, token >> 5]) >> int(token & 31)) & 1)
        )
    # xgrammar leaves rows below a rejected node untouched: zero every pruned row. (Through
    # numpy: a torch index_put here costs milliseconds on a busy CPU, numpy microseconds.)
    words[~keep] = 0
    return TreeMasks(keep, bitmask, timed_out=False)


def prune_tree(
    tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The surviving subtree, renumbered in the original order:
    (node_ids [M] into the input tree, tokens [M], parents [M] in the new numbering)."""
    tokens_np = np.asarray(tokens, dtype=np.int64)
    parents_np = np.asarray(parents, dtype=np.int64)
    node_ids = np.flatnonzero(keep)
    new_index = np.full(len(tokens_np), -1, dtype=np.int64)
    new_index[node_ids] = np.arange(len(node_ids))
    new_parents = np.where(parents_np[node_ids] >= 0, new_index[parents_np[node_ids]], -1)
    return node_ids, tokens_np[node_ids], new_parents


def _check_tree(tokens: np.ndarray, parents: np.ndarray) -> None:
    if len(tokens) == 0 or len(tokens) != len(parents):
        raise ValueError("a tree needs at least the root, and one parent per token")
    if parents[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    idx = np.arange(1, len(parents))
    if np.any(parents[1:] < 0) or np.any(parents[1:] >= idx):
        raise ValueError("parents[i] must be in [0, i) for every non-root node")
