"""Grammar-constrained decoding inside the engine step (xgrammar through prescient.grammar).

For every scheduled request that samples this step and carries a grammar:

1. `prepare` resolves its compile (started when the request arrived, so it overlapped queueing
   and prefill), then shapes its draft tree: a *forced span* (the grammar admits one
   continuation: JSON keys, punctuation, tool-call scaffolding) becomes the draft chain itself,
   tokens the target then verifies for free in the same forward, branching where the span ends
   at a narrow choice (an enum value, a tool name: one branch per allowed token, each with the
   span it forces, `Matcher.draft_paths`); otherwise the proposer's tree
   is cut to its grammar-valid subtree before verification (no target compute on forbidden
   tokens), and every surviving node gets its own next-token mask.
2. `apply` masks the logits rows (forbidden -> -inf) before sampling / verification, so plain
   and speculative decoding pick from the same constrained distribution (lossless).
3. `advance` moves the matcher over the committed tokens; a completed grammar finishes the request.
   When the grammar then allows nothing but the stop token, `append_forced_stop` commits it at
   once instead of spending a forward on a foregone conclusion; a forced span that runs to the
   end of the grammar ends with the stop token (matcher.forced_tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from prescient.kernels import ops
from prescient.runtime.request import SOURCE_FORCED, Request
from prescient.speculative.tree import DraftTree


@dataclass
class GrammarStats:
    num_masked_rows: int = 0
    mask_seconds: float = 0.0
    mask_seconds_per_row: list[float] = field(default_factory=list)  # recent, for p50/p99
    num_forced_tokens_proposed: int = 0
    num_pruned_nodes: int = 0
    num_forced_stops: int = 0  # stop tokens committed without a forward (append_forced_stop)
    num_grammar_branch_tokens: int = 0  # draft nodes on the grammar's narrow choices (draft_paths)
    num_span_tail_tokens: int = 0  # proposer draft nodes grafted after a forced span


@dataclass
class PreparedMasks:
    bitmask: torch.Tensor  # [num_logits, num_words] int32, rows of unconstrained requests all-ones
    forced: list[int]  # per seq: its tree starts with a forced span of this many tokens


def resolve_matcher(request: Request):
    """Turn a pending compile / compiled grammar into the request's matcher (raises
    GrammarError on a failed or timed-out compile)."""
    g = request.grammar
    if hasattr(g, "result"):  # PendingGrammar
        g = g.result()
    if hasattr(g, "matcher"):  # CompiledGrammar
        g = g.matcher()
    request.grammar = g
    return g


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


def _graft(chain: DraftTree, tail: DraftTree) -> DraftTree:
    """`tail` (rooted at the chain's last token) hung below the chain's last node."""
    last = chain.num_nodes - 1
    parents = [last if p == 0 else p + last for p in tail.parents[1:]]
    return DraftTree(list(chain.tokens) + list(tail.tokens[1:]), list(chain.parents) + parents)


def _bit(token: int) -> int:
    """The int32 word value with bit `token % 32` set (bit 31 is the sign bit)."""
    b = 1 << (token % 32)
    return b - (1 << 32) if b >= 1 << 31 else b


class GrammarStep:
    def __init__(self, vocab_size: int, stop_token_ids: tuple[int, ...] = ()):
        self.vocab_size = vocab_size  # the model's logits width
        self.stop_token_ids = stop_token_ids
        self.num_words = (vocab_size + 31) // 32
        self.stats = GrammarStats()

    def prepare(self, seqs, trees: list[DraftTree | None], propose_after=None
                ) -> tuple[list[DraftTree | None], PreparedMasks | None]:
        """Returns the (possibly pruned / forced) trees and the bitmask for the logits rows, or
        None when no scheduled request is constrained.

        `propose_after(seq, span, budget) -> DraftTree | None` (Speculator.propose_after) drafts
        what follows a forced span: a JSON key is forced, its value is often copied from the
        prompt, and proposing both verifies them in one forward instead of two."""
        if not any(s.samples and s.request.grammar is not None for s in seqs):
            return trees, None
        t0 = time.perf_counter()
        trees = list(trees)
        forced = [0] * len(seqs)
        blocks: list[torch.Tensor] = []
        for i, seq in enumerate(seqs):
            if not seq.samples:
                continue
            request = seq.request
            tree = trees[i]
            num_rows = tree.num_nodes if tree is not None else 1
            if request.grammar is None:
                blocks.append(torch.full((num_rows, self.num_words), -1, dtype=torch.int32))
                continue
            matcher = request.grammar
            root = request.all_token_ids[-1]
            paths = grammar_draft_paths(matcher, seq.num_spec_slots) if request.params.speculate else []
            if paths:
                # the forced span (shared by every path) and the grammar's narrow choices after it
                span = len(matcher.forced_tokens()[:seq.num_spec_slots])
                tail = None
                if (propose_after is not None and len(paths) == 1 and len(paths[0]) == span
                        and paths[0][-1] not in self.stop_token_ids):
                    tail = propose_after(seq, paths[0], min(SPAN_TAIL_BUDGET, seq.num_spec_slots - span))
                tree = _graft(DraftTree.chain(root, paths[0]), tail) if tail is not None \
                    else DraftTree.from_paths(root, paths)
                forced[i] = span
                self.stats.num_forced_tokens_proposed += span
                if tail is not None:
                    self.stats.num_span_tail_tokens += tail.num_nodes - 1
                else:
                    self.stats.num_grammar_branch_tokens += tree.num_nodes - 1 - span
            if tree is not None:
                from prescient.grammar import prune_tree, tree_masks

                masks = tree_masks(matcher, list(tree.tokens), list(tree.parents))
                if not masks.keep.all():
                    node_ids, tokens, parents = prune_tree(list(tree.tokens), list(tree.parents), masks.keep)
                    self.stats.num_pruned_nodes += tree.num_nodes - len(node_ids)
                    tree = DraftTree(tokens.tolist(), parents.tolist()) if len(node_ids) > 1 else None
                    rows = masks.bitmask[torch.from_numpy(node_ids)]
                else:
                    rows = masks.bitmask
                trees[i] = tree
                blocks.append(self._widen(rows))
            else:
                from prescient.grammar import allocate_bitmask

                row = allocate_bitmask(1, matcher.tokenizer.vocab_size)
                matcher.fill_bitmask(row, 0)
                blocks.append(self._widen(row))
            self.stats.num_masked_rows += blocks[-1].shape[0]
        bitmask = torch.cat(blocks) if blocks else torch.empty(0, self.num_words, dtype=torch.int32)
        # A row that allows nothing (the node after a stop token: its successors are cut at
        # commit) would turn into NaN probabilities; let it allow the stop tokens instead.
        dead = (bitmask == 0).all(dim=1)
        if dead.any():
            for token in self.stop_token_ids:
                bitmask[dead, token // 32] |= _bit(token)
        dt = time.perf_counter() - t0
        self.stats.mask_seconds += dt
        self.stats.mask_seconds_per_row.append(dt / max(1, bitmask.shape[0]))
        del self.stats.mask_seconds_per_row[:-4096]
        return trees, PreparedMasks(bitmask, forced)

    def _widen(self, rows: torch.Tensor) -> torch.Tensor:
        """Grammar vocab -> model vocab width (tokens the tokenizer lacks are never allowed)."""
        if rows.shape[1] == self.num_words:
            return rows
        out = torch.zeros(rows.shape[0], self.num_words, dtype=torch.int32)
        w = min(rows.shape[1], self.num_words)
        out[:, :w] = rows[:, :w]
        return out

    @staticmethod
    def apply(logits: torch.Tensor, masks: PreparedMasks | None) -> None:
        """logits: [num_logits, vocab] in place."""
        if masks is not None and masks.bitmask.shape[0]:
            ops.apply_token_bitmask(logits, masks.bitmask.to(logits.device))

    def append_forced_stop(self, request: Request, result) -> None:
        """When the grammar now allows only a stop token, commit it with this step's tokens: the
        next step's masked distribution would put all its mass on it, so running that forward
        changes nothing but the latency (one whole step per constrained reply at batch 1)."""
        matcher, params = request.grammar, request.params
        # stop strings are matched on the text after the tokens are appended; a forced stop token
        # there would add a token plain decoding never samples
        if (matcher is None or matcher.is_terminated() or params.ignore_eos or params.logprobs is not None
                or params.stop):
            return
        forced = matcher.forced_tokens()
        if len(forced) == 1 and forced[0] in self.stop_token_ids:
            matcher.accept_token(forced[0])
            result.tokens.append(forced[0])
            result.sources.append(SOURCE_FORCED)
            self.stats.num_forced_stops += 1

    @staticmethod
    def advance(request: Request, tokens: list[int]) -> int:
        """Accept committed tokens up to the one that completes the grammar (a stop token);
        returns how many were taken: what a step emits after that must not be committed. They
        were sampled under the mask, so a refusal before that is a bug."""
        matcher = request.grammar
        if matcher is None:
            return len(tokens)
        for n, token in enumerate(tokens, 1):
            if not matcher.accept_token(token):
                raise RuntimeError(f"grammar refused committed token {token} of request {request.request_id}")
            if matcher.is_terminated():
                return n
        return len(tokens)
