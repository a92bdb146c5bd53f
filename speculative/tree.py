"""`DraftTree`: the tokens one verify step checks, as a tree rooted at the last verified token.

Leaf module (imports nothing of prescient) so every layer may use it: proposers build trees, the
engine turns them into forward-batch rows (input ids, positions, attention mask bits), the
grammar prunes them, the verifier walks them. Only `tokens` and `parents` are stored; depth,
positions, masks and child/sibling links are derived from them (cached: a tree is immutable).

Node 0 is the root: the last verified token, whose logits give the distribution of the first
draft token. Nodes are in topological order (`parents[i] < i`), which lets every derivation and
the verify kernels run in one forward pass over node indices. Children of a node are ordered by
index: the verifier tries them in that order, so proposers put their best guess first.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch

# Bit l % 32 of word l // 32 (docs/CONTRACTS.md, `tree_attention` mask_bits).
_BITS_PER_WORD = 32


class DraftTree:
    """An immutable draft tree; `tokens[i]` sits below `parents[i]` (root: parent -1)."""

    def __init__(self, tokens: Sequence[int], parents: Sequence[int]) -> None:
        tokens, parents = tuple(map(int, tokens)), tuple(map(int, parents))
        if not tokens:
            raise ValueError("a draft tree has at least its root node")
        if len(tokens) != len(parents):
            raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
        if parents[0] != -1:
            raise ValueError("node 0 is the root: its parent must be -1")
        # parents[i] < i for every non-root node (C-level loops: trees are built every step)
        if len(parents) > 1 and (min(parents[1:]) < 0 or not all(map(int.__lt__, parents[1:], range(1, len(parents))))):
            bad = next(i for i in range(1, len(parents)) if not 0 <= parents[i] < i)
            raise ValueError(f"parents[{bad}] = {parents[bad]}: nodes must follow their parents")
        if min(tokens) < 0:
            raise ValueError("token ids must be >= 0")
        self.tokens: tuple[int, ...] = tokens
        self.parents: tuple[int, ...] = parents

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def chain(cls, root_token: int, tokens: Sequence[int]) -> DraftTree:
        """A single path: root, tokens[0], tokens[1], ... (plain chain speculation)."""
        return cls([root_token, *tokens], range(-1, len(tokens)))

    @classmethod
    def from_paths(cls, root_token: int, paths: Sequence[Sequence[int]]) -> DraftTree:
        """Merge token paths (each continuing the root) into a trie: common prefixes share nodes.

        Nodes are numbered in order of first appearance, so the first path is the first child
        at every branching point (tried first by the verifier) and the order is topological."""
        tokens, parents = [root_token], [-1]
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            node = 0
            for token in path:
                child = children.get((node, token))
                if child is None:
                    child = len(tokens)
                    children[(node, token)] = child
                    tokens.append(token)
                    parents.append(node)
                node = child
        return cls(tokens, parents)

    def truncate(self, keep_mask: Sequence[bool]) -> DraftTree:
        """Keep the nodes whose keep_mask is set AND whose ancestors are all kept; reindex.
        The root is always kept (it is a verified token, not a guess)."""
        kept = self.kept_nodes(keep_mask)
        new_index = {old: new for new, old in enumerate(kept)}
        parents = [-1] + [new_index[self.parents[old]] for old in kept[1:]]
        return DraftTree([self.tokens[old] for old in kept], parents)

    def prune(self, drop_nodes: Sequence[int]) -> DraftTree:
        """Drop the given nodes and all their descendants; reindex."""
        keep = [True] * self.num_nodes
        for node in drop_nodes:
            keep[node] = False
        return self.truncate(keep)

    def kept_nodes(self, keep_mask: Sequence[bool]) -> list[int]:
        """Old indices of the nodes `truncate(keep_mask)` keeps, in order (for reindexing side
        data such as per-node draft probabilities: `draft_probs[kept]`)."""
        if len(keep_mask) != self.num_nodes:
            raise ValueError(f"keep_mask has {len(keep_mask)} entries for {self.num_nodes} nodes")
        alive = [True] * self.num_nodes
        for i in range(1, self.num_nodes):
            # Parents come first, so alive[parent] is already final.
            alive[i] = bool(keep_mask[i]) and alive[self.parents[i]]
        return [i for i in range(self.num_nodes) if alive[i]]

    # -- derived structure -----------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        """Nodes below the root: the guesses this tree asks the target to check."""
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        return self.tokens == other.tokens and self.parents == other.parents

    def __hash__(self) -> int:
        return hash((self.tokens, self.parents))

    def __repr__(self) -> str:
        return f"DraftTree(tokens={list(self.tokens)}, parents={list(self.parents)})"

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """Depth of each node (root 0): its distance from the last verified token."""
        depth = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depth[i] = depth[self.parents[i]] + 1
        return tuple(depth)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def position_ids(self, prefix_len: int) -> torch.Tensor:  # [num_nodes] int64
        """True sequence positions for RoPE: the root sits at prefix_len (the number of tokens
        before it), a node at prefix_len + depth, whatever its index."""
        return torch.tensor(self.depth, dtype=torch.int64) + prefix_len

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, in index order (the order the verifier tries them)."""
        children: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            children[self.parents[i]].append(i)
        return tuple(tuple(c) for c in children)

    @cached_property
    def first_child(self) -> tuple[int, ...]:
        """Lowest-index child of each node, -1 for a leaf."""
        return tuple(c[0] if c else -1 for c in self.children)

    @cached_property
    def next_sibling(self) -> tuple[int, ...]:
        """Next child of the same parent in index order, -1 for the last (and for the root)."""
        nxt = [-1] * self.num_nodes
        for kids in self.children:
            for a, b in zip(kids, kids[1:]):
                nxt[a] = b
        return tuple(nxt)

    @property
    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.first_child) if c == -1]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Draft tokens on the way to `node` (the root's token excluded)."""
        return [self.tokens[i] for i in self.path_to(node)[1:]]

    @cached_property
    def _ancestor_bits(self) -> tuple[int, ...]:
        """Per node, the nodes it attends to among the tree's (its ancestors and itself) as the
        set bits of one Python int: mask_bits and ancestor_mask are built every verify step,
        right after a forward has streamed the weights through the caches, where a few Python
        int operations a node cost far less than a torch call a node."""
        bits = [1]
        for i in range(1, self.num_nodes):
            bits.append(bits[self.parents[i]] | (1 << i))  # the parent's row is final: topological order
        return tuple(bits)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:  # [num_nodes, num_nodes] bool
        """mask[i, j] = node j is an ancestor of node i or i itself: what node i attends to
        among the tree's nodes (it also sees the whole verified prefix)."""
        n = self.num_nodes
        return torch.tensor([[(a >> j) & 1 for j in range(n)] for a in self._ancestor_bits], dtype=torch.bool)

    def mask_bits(self, num_words: int | None = None) -> torch.Tensor:  # [num_nodes, num_words] int32
        """ancestor_mask packed as CONTRACTS.md mask_bits: bit l % 32 of word l // 32 set iff the
        row's node attends node l. num_words pads to a batch-wide width (None = just enough)."""
        needed = (self.num_nodes + _BITS_PER_WORD - 1) // _BITS_PER_WORD
        num_words = needed if num_words is None else num_words
        if num_words < needed:
            raise ValueError(f"{self.num_nodes} nodes need {needed} mask words, got {num_words}")
        low = (1 << _BITS_PER_WORD) - 1
        # each word's low 32 bits read as int32: bit 31 set means a negative word
        words = [[w - (1 << _BITS_PER_WORD) if w >> (_BITS_PER_WORD - 1) else w
                  for w in ((a >> (_BITS_PER_WORD * k)) & low for k in range(num_words))]
                 for a in self._ancestor_bits]
        return torch.tensor(words, dtype=torch.int32)


def pack_trees(
    trees: Sequence[DraftTree],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a batch of trees to the kernel layout of docs/CONTRACTS.md (greedy_verify,
    rejection_sample): draft_tokens [num_seqs, max_nodes] int64 (padding -1), parents
    [num_seqs, max_nodes] int64 (padding -1), num_nodes [num_seqs] int64."""
    max_nodes = max((t.num_nodes for t in trees), default=1)
    shape = (len(trees), max_nodes)
    # One tensor build from padded Python rows: batches of many small trees stay cheap.
    draft_tokens = torch.tensor([t.tokens + (-1,) * (max_nodes - t.num_nodes) for t in trees],
                                dtype=torch.int64).reshape(shape)
    parents = torch.tensor([t.parents + (-1,) * (max_nodes - t.num_nodes) for t in trees],
                           dtype=torch.int64).reshape(shape)
    num_nodes = torch.tensor([t.num_nodes for t in trees], dtype=torch.int64)
    return draft_tokens, parents, num_nodes
