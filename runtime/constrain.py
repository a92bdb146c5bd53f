"""Grammar-constrained decoding inside the engine step (xgrammar through prescient.grammar).

For every scheduled request that samples this step and carries a grammar:

1. `prepare` cuts its draft tree (the proposer's, or the grammar-shaped one the speculator built
   from a forced span: speculative/grammar_drafts.py) to its grammar-valid subtree before
   verification (no target compute on forbidden tokens), and gives every surviving node its own
   next-token mask.
2. `apply` masks the logits rows (forbidden -> -inf) before sampling / verification, so plain
   and speculative decoding pick from the same constrained distribution (lossless).
3. `advance` moves the matcher over the committed tokens; a completed grammar finishes the request.
   When the grammar then allows nothing but the stop token, `append_forced_stop` commits it at
   once instead of spending a forward on a foregone conclusion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from prescient.kernels import ops
from prescient.runtime.request import SOURCE_FORCED, Request, RequestDeadEnd
from prescient.speculative.tree import DraftTree


@dataclass
class GrammarStats:
    num_masked_rows: int = 0
    mask_seconds: float = 0.0
    mask_seconds_per_row: list[float] = field(default_factory=list)  # recent, for p50/p99
    num_pruned_nodes: int = 0
    num_forced_stops: int = 0  # stop tokens committed without a forward (append_forced_stop)


@dataclass
class PreparedMasks:
    bitmask: torch.Tensor  # [num_logits, num_words] int32, rows of unconstrained requests all-ones


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

    def prepare(self, seqs, trees: list[DraftTree | None]
                ) -> tuple[list[DraftTree | None], PreparedMasks | None, dict[int, Exception]]:
        """Returns the pruned trees, the bitmask for the logits rows (None when no scheduled
        request is constrained) and the requests that failed here ({index in seqs: error}):
        their rows are left out of the bitmask, so the caller drops them from the batch."""
        failures: dict[int, Exception] = {}
        if not any(s.samples and s.request.grammar is not None for s in seqs):
            return trees, None, failures
        t0 = time.perf_counter()
        trees = list(trees)
        blocks: list[torch.Tensor] = []
        for i, seq in enumerate(seqs):
            if not seq.samples:
                continue
            try:
                trees[i], block = self._prepare_one(seq.request, trees[i])
            except Exception as e:  # this request's grammar: its failure alone (the engine ends it)
                failures[i] = e
                continue
            blocks.append(block)
            if seq.request.grammar is not None:
                self.stats.num_masked_rows += block.shape[0]
        bitmask = torch.cat(blocks) if blocks else torch.empty(0, self.num_words, dtype=torch.int32)
        # A row that allows nothing (the node after a stop token: its successors are cut at
        # commit) would turn into NaN probabilities; let it allow the stop tokens instead.
        # (A request's own row, the tree's root, never gets here dead: _prepare_one refuses it.)
        # (numpy on the tensor's memory: each torch reduction here cost ~30 us right after a forward)
        dead = ~bitmask.numpy().any(axis=1)
        if dead.any():
            dead_rows = torch.from_numpy(dead)
            for token in self.stop_token_ids:
                bitmask[dead_rows, token // 32] |= _bit(token)
        dt = time.perf_counter() - t0
        self.stats.mask_seconds += dt
        self.stats.mask_seconds_per_row.append(dt / max(1, bitmask.shape[0]))
        del self.stats.mask_seconds_per_row[:-4096]
        return trees, PreparedMasks(bitmask), failures

    def _prepare_one(self, request: Request, tree: DraftTree | None) -> tuple[DraftTree | None, torch.Tensor]:
        """One request's pruned tree and mask rows [num_rows, num_words]. Raises RequestDeadEnd
        when its grammar allows no token where its output stands."""
        num_rows = tree.num_nodes if tree is not None else 1
        if request.grammar is None:
            return tree, torch.full((num_rows, self.num_words), -1, dtype=torch.int32)
        matcher = request.grammar
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
        else:
            from prescient.grammar import allocate_bitmask

            rows = allocate_bitmask(1, matcher.tokenizer.vocab_size)
            matcher.fill_bitmask(rows, 0)
        rows = self._widen(rows)
        if not rows[0].numpy().any():
            # the grammar admits nothing here (e.g. an empty character class): sampling would
            # have to pick a token the matcher then refuses; end this request, not the step
            raise RequestDeadEnd(f"the grammar allows no token at output position {len(request.output_token_ids)} "
                                 "(it can neither continue nor end there)")
        return tree, rows

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
        # the stop-only check, not forced_tokens(): that looks up the whole forced text, which a
        # grammar may make arbitrarily long (grammar/forced_bound.py)
        stop = matcher.forced_stop()
        if stop is not None and stop in self.stop_token_ids:
            matcher.accept_token(stop)
            result.tokens.append(stop)
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
                raise RuntimeError(f"the grammar refused committed token {token} (output position "
                                   f"{len(request.output_token_ids) + n - 1})")
            if matcher.is_terminated():
                return n
        return len(tokens)
