"""Matcher: one per constrained request, a thin wrapper around xgrammar.GrammarMatcher (or, for
grammars compiled by llguidance, llg_backend.LLGHandle, which offers the same methods).

The engine advances it with every committed token (`accept_token`), undoes rejected speculation
with `rollback`, and asks it for the next-token mask of its row in the batch bitmask
(`[num_rows, ceil(vocab_size / 32)]` int32 on CPU, bit set = allowed; copy it to the device).
`BatchMaskFiller` fills many rows at once on xgrammar's thread pool.

Forced spans (jump-forward): when the grammar admits exactly one continuation, `forced_tokens()`
returns it tokenized by the model's own tokenizer, so the tokens are canonical, minus the last
token, whose bytes could merge with whatever follows (`{"name` may become one token once `"`
is known). The engine proposes them as free draft tokens; `draft_paths()` adds, where the
span ends at a narrow choice (an enum, a tool name), one branch per allowed token with the span
that choice forces, for a draft tree. Grammars whose forced runs may be too long to look up
every step (grammar/forced_bound.py) get matchers with `forced_spans=False`, which propose none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Literal, Sequence

import numpy as np
import torch
import xgrammar as xgr

from prescient.grammar.forced_bound import MAX_FORCED_RUN

if TYPE_CHECKING:
    from prescient.grammar.tokenizer import GrammarTokenizer


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 CPU, all tokens allowed. Allocated through numpy:
    torch.full (xgrammar's allocator) takes ~8 ms for 32 rows on a busy 2-core CPU, as its
    intra-op threads contend; numpy takes ~50 us."""
    return torch.from_numpy(np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32))


# Draft nodes past a forced span that narrow grammar choices may use, and how many choice levels
# deep (Matcher.draft_paths). Off by default: on the tool_call workloads (2-core CPU, bf16) the
# branches cost more than the steps they save (grammar + n-gram decode 1.88x plain with 0,
# 1.77x with 8, 1.72x with 16: the mask fills and forks per step, and wider verify trees).
BRANCH_BUDGET = 0
BRANCH_DEPTH = 2
MAX_ALLOWED = 32  # a wider choice (free text, numbers) is not worth enumerating


# Forced-span lookups: the text is cut to MAX_FORCED_CHARS before it is tokenized (tokenizing and
# accepting it run at Python speed, and no draft uses more than a few dozen tokens of it); a
# jump-forward text longer than the grammar's bound promised (forced_bound.py: runs that nested
# recursion multiplied) switches the matcher's lookups off.
MAX_FORCED_CHARS = 1024


class Matcher:
    def __init__(self, compiled: xgr.CompiledGrammar, tokenizer: "GrammarTokenizer",
                 _handle: xgr.GrammarMatcher | None = None, forced_spans: bool = True):
        self.tokenizer = tokenizer
        self._compiled = compiled
        self.forced_spans = forced_spans  # False: forced_tokens / draft_paths propose nothing
        self.handle = _handle or xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(tokenizer.stop_token_ids)
        )
        self.num_tokens = 0  # accepted and not rolled back; rollback cannot go past 0
        self._version = 0  # bumped on every state change; keys the forced-span cache
        self._forced: tuple[int, list[int]] = (-1, [])
        self._paths: tuple[tuple[int, int], list[list[int]]] = ((-1, 0), [])

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        ok = self.handle.accept_token(int(token_id))
        self.num_tokens += ok
        self._version += ok
        return ok

    def accept_tokens(self, token_ids: Iterable[int]) -> int:
        """Accept tokens in order up to the first forbidden one; returns how many were taken."""
        n = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            n += 1
        return n

    def rollback(self, num_tokens: int = 1) -> None:
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens:
            self.handle.rollback(num_tokens)
            self.num_tokens -= num_tokens
            self._version += 1

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and nothing more is allowed."""
        return self.handle.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (a stop token is allowed next)."""
        return self.handle.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> bool:
        """Write the allowed-next-token mask to `bitmask[row]`; False if it allows everything."""
        return self.handle.fill_next_token_bitmask(bitmask, row)

    def allows_nothing(self) -> bool:
        """Whether no token may follow (a grammar such as `root ::= [^\\x00-\\U0010FFFF]` compiles
        but admits nothing): not terminated, and an empty next-token mask."""
        if self.handle.is_terminated():
            return False
        row = allocate_bitmask(1, self.tokenizer.vocab_size)
        self.handle.fill_next_token_bitmask(row, 0)
        return not bool(row.any())

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (canonically tokenized, last one held back).
        Cached until the matcher next changes: the engine asks more than once per step."""
        if not self.forced_spans:
            return []
        if self._forced[0] != self._version:
            self._forced = (self._version, self._find_forced())
        return list(self._forced[1])

    def draft_paths(self, budget: int, branch_budget: int | None = None, max_branches: int = 8) -> list[list[int]]:
        """Continuations the grammar nearly dictates, as token paths from the current state, at
        most `budget` tokens in all: the forced span and, where it ends at a choice among at most
        `max_branches` tokens (an enum value, a tool name, a key among few), one path per allowed
        token, each followed by what that choice forces (and, one level deeper, the same again),
        using at most `branch_budget` nodes past the span (default: BRANCH_BUDGET). The engine
        verifies them as a draft tree: whichever branch the target picks comes with its forced
        tail in the same forward. [] when nothing is forced and the choice is wide. Cached until
        the matcher next changes."""
        if not self.forced_spans:
            return []
        branch_budget = BRANCH_BUDGET if branch_budget is None else branch_budget
        key = (self._version, budget, branch_budget, max_branches)
        if self._paths[0] != key:
            span = self.forced_tokens()[:budget]
            paths = [span]
            room = min(budget - len(span), branch_budget)
            if room > 0 and not (span and span[-1] in self.tokenizer.stop_token_ids):
                probe = self.handle.fork()
                for token_id in span:
                    probe.accept_token(token_id)
                tails = self._branches(probe, room, max_branches, depth=BRANCH_DEPTH)
                paths = [span + tail for tail in tails] if tails else paths
            self._paths = (key, [p for p in paths if p])
        return [list(p) for p in self._paths[1]]

    def _branches(self, handle: xgr.GrammarMatcher, room: int, max_branches: int, depth: int) -> list[list[int]]:
        """Paths of at most `room` trie nodes from `handle`'s state, which is at a choice: one per
        allowed token (if at most max_branches), each with the span it forces and, `depth` - 1
        levels further, its own narrow choices. [] when the choice is wide or does not fit."""
        allowed = self._allowed(handle)
        if allowed is None or len(allowed) < 2:
            return []
        subtrees = []
        stops = set(self.tokenizer.stop_token_ids)
        for token_id in allowed:
            if token_id in stops:
                continue  # ending here is the target's call (and a terminated fork has no span)
            branch = handle.fork()
            branch.accept_token(token_id)
            # Keep the choices the tokenizer itself would make: "celsius" may be spelt c+elsius,
            # ce+lsius, ... and all are allowed, but a model writes the canonical one.
            text = self.tokenizer.token_texts[token_id] + branch.find_jump_forward_string()
            if self.tokenizer.encode(text)[:1] == [token_id]:
                subtrees.append((branch, [token_id] + self._forced_from(branch)))
        if not 1 <= len(subtrees) <= max_branches or room < len(subtrees):
            return []
        # every choice first, then the forced tails as far as the room allows (shortest first),
        # then, with what is left, the next level of choices below the tails that fit whole
        used = len(subtrees)
        per_branch: list[list[list[int]]] = [[full[:1]] for _, full in subtrees]
        whole = []
        for i in sorted(range(len(subtrees)), key=lambda i: len(subtrees[i][1])):
            full = subtrees[i][1]
            extra = min(len(full) - 1, room - used)
            per_branch[i] = [full[:1 + extra]]
            used += extra
            if extra == len(full) - 1 and full[-1] not in self.tokenizer.stop_token_ids:
                whole.append(i)
        for i in whole if depth > 1 else ():
            branch, full = subtrees[i]
            if room <= used:
                break
            for token_id in full[1:]:
                branch.accept_token(token_id)
            sub = self._branches(branch, room - used, max_branches, depth - 1)
            if sub:
                used += len({tuple(p[:k]) for p in sub for k in range(1, len(p) + 1)})
                per_branch[i] = [full + p for p in sub]
        return [path for paths in per_branch for path in paths]

    def _allowed(self, handle: xgr.GrammarMatcher, limit: int = MAX_ALLOWED) -> list[int] | None:
        """Token ids `handle`'s state allows next, or None when there are more than `limit`
        (free text allows most of the vocabulary: counted in numpy, never listed in Python)."""
        mask = allocate_bitmask(1, self.tokenizer.vocab_size)
        handle.fill_next_token_bitmask(mask, 0)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:self.tokenizer.vocab_size]
        if np.count_nonzero(bits) > limit:
            return None
        return np.flatnonzero(bits).tolist()

    def _find_forced(self) -> list[int]:
        return self._forced_from(self.handle)

    def _forced_from(self, handle: xgr.GrammarMatcher) -> list[int]:
        """The forced span from `handle`'s state (see forced_tokens)."""
        if handle.is_terminated():
            return []
        text = handle.find_jump_forward_string()
        if len(text) > MAX_FORCED_RUN:
            self.forced_spans = False  # see MAX_FORCED_CHARS
        cut = len(text) > MAX_FORCED_CHARS
        text = text[:MAX_FORCED_CHARS]
        token_ids = self.tokenizer.encode(text) if text else []
        probe = handle.fork()
        forced = []
        for token_id in token_ids:
            if not probe.accept_token(token_id):
                break  # cannot happen for a canonical tokenizer; keep what is valid
            forced.append(token_id)
        stop = None if cut else self._only_stop_after(probe)
        if stop is None:
            # Hold the last token back: its bytes could merge with the text that follows into
            # another token, and the model must be free to pick that canonical tokenization.
            return forced[:-1]
        # Nothing but the end can follow: no merge possible, and the stop token itself is forced.
        return forced + [stop]

    def _only_stop_after(self, probe: xgr.GrammarMatcher) -> int | None:
        """The stop token if, in `probe`'s state, the grammar allows it and nothing else; else
        None. With several stop tokens allowed, which one ends the reply is the target's choice
        (it shows in the finish reason), so none is forced."""
        if not probe.is_completed() or not self.tokenizer.stop_token_ids:
            return None
        allowed = self._allowed(probe, limit=1)
        return allowed[0] if allowed and allowed[0] in self.tokenizer.stop_token_ids else None

    def forced_stop(self) -> int | None:
        """The stop token when the grammar now allows it and nothing else, else None. Cheap (no
        forced-span lookup): whether the grammar is complete first, a mask only if it is."""
        return None if self.handle.is_terminated() else self._only_stop_after(self.handle)

    def fork(self) -> "Matcher":
        # type(self): an llguidance matcher (llg_backend.LLGMatcher) forks into its own kind
        twin = type(self)(self._compiled, self.tokenizer, _handle=self.handle.fork(), forced_spans=self.forced_spans)
        twin.num_tokens = self.num_tokens
        return twin


class BatchMaskFiller:
    """Fills the bitmask rows of many matchers. A mask row costs 1-6 us (xgrammar precomputes
    per-state masks), so on a 2-core CPU xgrammar's thread pool (BatchGrammarMatcher) only adds
    overhead up to at least 64 rows (measured: 186 vs 152 us at 64 rows, 51 vs 6 us at 1); it is
    used from `min_rows_for_threads` rows on."""

    def __init__(self, max_threads: int | Literal["auto"] = "auto",
                 min_rows_for_threads: int = 128):
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self.min_rows_for_threads = min_rows_for_threads

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
             rows: Sequence[int] | None = None) -> None:
        """bitmask: [num_rows, ceil(vocab_size / 32)] int32 CPU; matcher i fills rows[i]
        (default: row i)."""
        if rows is not None and len(rows) != len(matchers):
            raise ValueError("rows and matchers differ in length")
        rows = list(range(len(matchers))) if rows is None else list(rows)
        if len(matchers) < self.min_rows_for_threads:  # the usual case: each fills its row
            for m, row in zip(matchers, rows):
                m.fill_bitmask(bitmask, row)
            return
        # xgrammar's batch takes its own matchers only; llguidance ones (llg_backend.py) fill alone
        native, alone = [], []
        for i, m in enumerate(matchers):
            (native if isinstance(m.handle, xgr.GrammarMatcher) else alone).append(i)
        if len(native) < self.min_rows_for_threads:
            native, alone = [], range(len(matchers))
        for i in alone:
            matchers[i].fill_bitmask(bitmask, rows[i])
        if native:
            self._batch.batch_fill_next_token_bitmask([matchers[i].handle for i in native], bitmask,
                                                      [rows[i] for i in native])
