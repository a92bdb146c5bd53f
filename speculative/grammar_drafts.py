"""Draft trees shaped by a request's grammar: forced spans, narrow-choice branches, span tails.

When the grammar admits exactly one continuation (JSON keys, punctuation, tool-call
scaffolding), that *forced span* becomes the draft chain itself: tokens the target verifies for
free in the same forward. Where the span ends at a narrow choice (an enum value, a tool name)
the tree branches, one branch per allowed token with the span it forces (`Matcher.draft_paths`).
When the span is all the grammar proposes, the proposer drafts past it (`propose_after`, at most
`SPAN_TAIL_BUDGET` nodes): a forced key and the value the n-gram index copies from the prompt are
verified in one forward instead of two.

The speculator owns this (it is drafting); runtime/constrain.py only masks, prunes and advances.
"""

from __future__ import annotations

from typing import Callable

from prescient.speculative.tree import DraftTree

# Most draft nodes a constrained request gets for its forced span and the grammar's narrow
# choices after it, whatever the adaptive planner gives its proposer's drafts.
GRAMMAR_DRAFT_BUDGET = 32

# Most proposer draft nodes after a forced span (what the span's last key or tool name leads to).
SPAN_TAIL_BUDGET = 8


def grammar_draft_paths(matcher, slots: int = GRAMMAR_DRAFT_BUDGET) -> list[list[int]]:
    """The grammar's draft paths (Matcher.draft_paths) for a request with `slots` KV slots: the
    full-budget tree when it fits (the scheduler reserved slots for it), else one sized to fit."""
    if slots <= 0:
        return []
    paths = matcher.draft_paths(GRAMMAR_DRAFT_BUDGET)
    return paths if tree_size(paths) <= slots else matcher.draft_paths(slots)


def tree_size(paths: list[list[int]]) -> int:
    """Draft nodes of the trie the paths make (shared prefixes counted once)."""
    return len({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)})


def graft(chain: DraftTree, tail: DraftTree) -> DraftTree:
    """`tail` (rooted at the chain's last token) hung below the chain's last node."""
    last = chain.num_nodes - 1
    parents = [last if p == 0 else p + last for p in tail.parents[1:]]
    return DraftTree(list(chain.tokens) + list(tail.tokens[1:]), list(chain.parents) + parents)


def grammar_tree(seq, stop_token_ids: tuple[int, ...],
                 propose_after: Callable[[object, list[int], int], DraftTree | None] | None
                 ) -> tuple[DraftTree, int, int] | None:
    """The grammar-shaped draft of a constrained request (`seq.request.grammar` a matcher), or
    None when the grammar forces nothing here. Returns (tree, forced span length, proposer tail
    nodes). The tree's nodes are grammar-valid by construction, except a tail's (pruned later)."""
    request = seq.request
    paths = grammar_draft_paths(request.grammar, seq.num_spec_slots)
    if not paths:
        return None
    root = request.all_token_ids[-1]
    # the forced span (shared by every path) and the grammar's narrow choices after it
    span = len(request.grammar.forced_tokens()[:seq.num_spec_slots])
    tail = None
    if (propose_after is not None and len(paths) == 1 and len(paths[0]) == span
            and paths[0][-1] not in stop_token_ids):
        tail = propose_after(seq, paths[0], min(SPAN_TAIL_BUDGET, seq.num_spec_slots - span))
    if tail is not None:
        return graft(DraftTree.chain(root, paths[0]), tail), span, tail.num_nodes - 1
    return DraftTree.from_paths(root, paths), span, 0
