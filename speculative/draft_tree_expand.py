"""The EAGLE-2 dynamic draft tree of one request, grown one depth per draft forward.

Pure bookkeeping (no model, no KV): `draft_model.DraftModelProposer` runs the forwards and feeds
each expanded node's top-k draft log-probabilities back here.

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", Sec. 4) grows the tree from the draft's own confidence: a node's value is its
cumulative draft log-probability (the log of the draft's estimate that the target reaches it).
- Expansion: at each depth, the `top_k` newest nodes with the highest value are forwarded and
  each gets its `top_k` most likely children.
- Reranking: the `budget` nodes with the highest value over everything generated form the tree.
  A child never scores above its parent (log-probs are <= 0), so the kept set is closed under
  ancestors: always a tree.
Two additions of ours: the draft's greedy node (argmax child of argmax child ...) is always
expanded, so the tree's first path is the greedy chain for as long as its value ranks, and that
path's KV stays in place for the next step; and a frontier node with at least `budget - 1` nodes
ranked above it is not forwarded, since none of its children could be kept (this is what stops an
unconfident draft early: fewer rows and fewer draft forwards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prescient.speculative.tree import DraftTree


class DynamicTree:
    """Candidate nodes of one request's draft tree; node 0 is the root (the last verified token).

    Nodes are numbered in creation order, so parents come first."""

    def __init__(self, root_token: int, budget: int, max_depth: int, top_k: int) -> None:
        if budget < 1 or max_depth < 1 or top_k < 1:
            raise ValueError(f"budget, max_depth and top_k must be >= 1, got {budget}, {max_depth}, {top_k}")
        self.budget = budget  # most draft nodes the final tree keeps
        # A chain of `budget` nodes is as deep as a kept node can be.
        self.max_depth = min(max_depth, budget)
        self.top_k = min(top_k, budget)
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.scores: list[float] = [0.0]  # cumulative draft log-probability
        self.greedy: list[bool] = [True]  # on the draft's greedy chain
        self._newest: list[int] = [0]  # nodes made by the last expansion

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def _key(self, node: int) -> tuple[float, int, int]:
        # Highest value first; on a tie the shallower (then older) node, so that a parent always
        # ranks before its child and the kept set stays closed under ancestors.
        return (-self.scores[node], self.depths[node], node)

    def expand(self, nodes: Sequence[int],
               top_tokens: torch.Tensor,  # [len(nodes), top_k] int64, most likely first
               top_logprobs: torch.Tensor,  # [len(nodes), top_k] draft log-probabilities
               ) -> None:
        """Give each forwarded node its top-k children (the nodes the next frontier picks from)."""
        created = []
        for node, tokens, logprobs in zip(nodes, top_tokens.tolist(), top_logprobs.tolist()):
            for rank, (token, logprob) in enumerate(zip(tokens[: self.top_k], logprobs[: self.top_k])):
                self.tokens.append(int(token))
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                # log_softmax can round a near-certain token to a hair above 0; a child must not
                # outrank its parent.
                self.scores.append(self.scores[node] + min(float(logprob), 0.0))
                self.greedy.append(self.greedy[node] and rank == 0)
                created.append(self.num_nodes - 1)
        self._newest = created

    def frontier(self) -> list[int]:
        """Nodes to forward next (their logits give the next depth's candidates); [] when done.

        The greedy node, if among the candidates, comes first."""
        if not self._newest or self.depths[self._newest[0]] >= self.max_depth:
            return []
        picked = sorted(self._newest, key=self._key)[: self.top_k]
        picked += [n for n in self._newest if self.greedy[n] and n not in picked]
        ranked = sorted(range(1, self.num_nodes), key=self._key)
        rank = {node: r for r, node in enumerate(ranked)}
        # A child has at least its parent and everything above the parent ranked above it.
        useful = [n for n in picked if rank[n] < self.budget - 1]
        return sorted(useful, key=lambda n: (not self.greedy[n], self._key(n)))

    def rows(self, frontier: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """The nodes one draft forward computes for `frontier`: every frontier node and its
        ancestors below the root (their KV is not kept between forwards, see the module
        docstring of draft_model). -> (node ids, attend [num_rows, num_rows] bool).

        The first frontier node's path comes first, in depth order: its rows sit exactly at their
        sequence positions, so that path's KV is valid causal KV for the next step."""
        first_path = []
        node = frontier[0]
        while node > 0:
            first_path.append(node)
            node = self.parents[node]
        first_path.reverse()
        placed = set(first_path)
        rest = set()
        for node in frontier[1:]:
            while node > 0 and node not in placed and node not in rest:
                rest.add(node)
                node = self.parents[node]
        order = first_path + sorted(rest, key=lambda n: (self.depths[n], n))
        row_of = {node: r for r, node in enumerate(order)}
        attend = torch.zeros(len(order), len(order), dtype=torch.bool)
        for r, node in enumerate(order):
            while node > 0:  # itself and its ancestors below the root
                attend[r, row_of[node]] = True
                node = self.parents[node]
        return order, attend

    def build(self, first: Sequence[int] = ()) -> DraftTree:
        """EAGLE-2 reranking: the `budget` highest-valued nodes, as a DraftTree whose children
        are ordered best first (the verifier tries them in index order); depth-first numbering
        puts the first path at nodes 1, 2, ... (in place in the target's KV: no copy).

        first: tokens of a chain from another draft (an n-gram copy) placed first; the ranked
        nodes then fill what is left of the budget, a node the chain already holds costing
        nothing (the union of both drafts: the verifier accepts along whichever is right)."""
        kids: list[list[int]] = [[]]  # the union's nodes: children in insertion order
        tokens, index = [self.tokens[0]], {}  # (union node, token) -> union node

        def add(parent: int, token: int) -> int | None:
            node = index.get((parent, token))
            if node is None and len(tokens) <= self.budget:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                kids.append([])
                kids[parent].append(node)
            return node

        node = 0
        for token in first:
            node = add(node, int(token))
            if node is None:
                break
        mapped = {0: 0}  # a ranked node -> its union node
        for node in sorted(range(1, self.num_nodes), key=self._key):
            union = add(mapped[self.parents[node]], self.tokens[node])
            if union is None:  # the budget is spent (a later node the chain holds would be free: rare, left out)
                break
            mapped[node] = union
        out_tokens, out_parents = [], []
        stack = [(0, -1)]  # (union node, index of its parent in the output)
        while stack:
            node, parent = stack.pop()
            out_tokens.append(tokens[node])
            out_parents.append(parent)
            here = len(out_tokens) - 1
            stack.extend((child, here) for child in reversed(kids[node]))
        return DraftTree(out_tokens, out_parents)
