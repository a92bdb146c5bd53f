"""N-gram / suffix proposer: guess the continuation of text the request (or its session) has seen.

Agents copy: tool outputs, earlier answers, JSON they were asked to edit. So the next tokens
often continue an earlier occurrence of the sequence's current suffix. Each step:

1. find match sites: earlier end positions `e` whose preceding tokens equal the longest suffix of
   the sequence (`min_match`..`max_match` tokens), in the request's own prompt + output first,
   then in the session's earlier turns (most recent first);
2. each site proposes the tokens that followed it; sites are weighted by match length
   (longer = more specific context) and merged into a trie, so where continuations diverge the
   draft branches;
   The tenant's shared suffix pool (suffix_pool.py: recent outputs of all its sessions) adds
   one continuation per pool generation, weighted as a site of its match length (capped at
   `max_match`) at half weight, so the request's own text wins ties;
3. the `max_draft_tokens` best trie nodes (weight x depth_decay^depth) form the `DraftTree`: a
   best-first selection in the spirit of EAGLE-2's dynamic trees, keeping the nodes most likely
   to be reached.

Cost per step must stay in microseconds, so nothing is rescanned: each sequence keeps a
zlib-style hash-chain index per n-gram length in a ladder (e.g. 8, 4, 2 tokens): `head[hash]` =
latest end position of that n-gram, `prev[e]` = the previous end with the same hash. Appending a
token adds one entry per level; a lookup walks a few chain links (most recent first) and measures
each candidate's true match length by comparing tokens (which also rejects hash collisions).
Entries are appended in order, so an index can also be rolled back (`truncate`): a session's
next turn, whose prompt repeats the previous turn, takes over that turn's index instead of
indexing its whole prompt again.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from prescient.speculative.proposer import ProposalContext, register_proposer
from prescient.speculative.suffix_pool import PoolConfig, SharedSuffixPool
from prescient.speculative.tree import DraftTree


@dataclass(frozen=True)
class NgramConfig:
    min_match: int = 2  # shortest suffix worth copying from
    max_match: int = 8  # longest suffix compared (longer contexts rarely disagree)
    max_sites: int = 8  # continuations merged into one tree
    max_chain: int = 16  # chain links walked per ladder level (bounds the lookup cost)
    # Node score = site weight x depth_decay^depth: lower favours second guesses for the next
    # tokens (branches) over depth along the best guess.
    depth_decay: float = 0.9
    max_session_tokens: int = 32768  # history kept per session; oldest turns dropped first
    max_sessions: int = 256  # least recently used sessions dropped beyond this
    # the tenants' shared pool of recent outputs; None: none (requests' `tenant` is ignored)
    pool: PoolConfig | None = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if not 0 < self.depth_decay <= 1:
            raise ValueError(f"depth_decay must be in (0, 1], got {self.depth_decay}")
        for name in ("max_sites", "max_chain", "max_session_tokens", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def levels(self) -> tuple[int, ...]:
        """Indexed n-gram lengths, longest first: max_match, halving, down to min_match."""
        levels, n = [], self.max_match
        while n > self.min_match:
            levels.append(n)
            n //= 2
        return (*levels, self.min_match)


class SequenceIndex:
    """Hash-chain index of one growing token sequence (see the module docstring)."""

    def __init__(self, levels: Sequence[int], max_match: int) -> None:
        self.tokens: list[int] = []
        self.levels = tuple(levels)
        self.max_match = max_match
        self._heads: list[dict[int, int]] = [{} for _ in self.levels]
        # prev[e] for every end position e in 0..len (entries below n stay -1).
        self._prevs: list[array] = [array("q", [-1] * n) for n in self.levels]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(new_tokens)
        if len(tokens) == start + 1:  # the per-step case: one committed token
            self._append_end(len(tokens))
            return
        for n, head, prev in zip(self.levels, self._heads, self._prevs):
            first_end = max(start + 1, n)
            if first_end > len(tokens):
                continue
            # The n-grams ending at first_end..len, built by zip at C speed (one per end).
            grams = zip(*(tokens[first_end - n + j : len(tokens) - n + 1 + j] for j in range(n)))
            get, append, end = head.get, prev.append, first_end
            for key in map(hash, grams):
                append(get(key, -1))
                head[key] = end
                end += 1

    def truncate(self, length: int) -> None:
        """Forget the tokens past `length`. Entries were appended in order, so undoing them
        newest first restores every chain head exactly."""
        tokens = self.tokens
        for n, head, prev in zip(self.levels, self._heads, self._prevs):
            for end in range(len(tokens), max(length, n - 1), -1):
                key = hash(tuple(tokens[end - n : end]))
                before = prev.pop()
                if before == -1:
                    del head[key]
                else:
                    head[key] = before
        del tokens[length:]

    def _append_end(self, end: int) -> None:
        tokens = self.tokens
        for n, head, prev in zip(self.levels, self._heads, self._prevs):
            if end >= n:
                key = hash(tuple(tokens[end - n : end]))
                prev.append(head.get(key, -1))
                head[key] = end

    def find_sites(self, suffix: list[int], max_sites: int, max_chain: int, min_len: int) -> list[tuple[int, int]]:
        """(match_len, end) of up to max_sites earlier ends e < len whose preceding tokens match
        the end of `suffix` for at least min_len tokens; longest first, then most recent."""
        tokens, limit, max_len = self.tokens, len(self.tokens), min(self.max_match, len(suffix))
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n, head, prev in zip(self.levels, self._heads, self._prevs):
            if n > len(suffix):
                continue
            gram = suffix[-n:]
            end, links = head.get(hash(tuple(gram)), -1), 0
            while end != -1 and links < max_chain:
                links += 1
                # end == limit is the suffix itself: a site needs a token after it.
                if end < limit and end not in seen and tokens[end - n : end] == gram:
                    seen.add(end)
                    length = n
                    while length < max_len and end > length and tokens[end - length - 1] == suffix[-length - 1]:
                        length += 1
                    if length >= min_len:
                        found.append((length, end))
                end = prev[end]
            # Sites first met at a shorter level match fewer than n tokens (longer ones sit in
            # this level's chain), so they cannot beat min_len or a full list of n-long sites.
            if n <= min_len or len(found) >= max_sites:
                break
        found.sort(key=lambda site: (-site[0], -site[1]))
        return found[:max_sites]


@dataclass
class _RequestState:
    session_id: str | None
    index: SequenceIndex


class NgramProposer:
    """`Proposer` over the request's own tokens and its agent session's earlier turns."""

    # A context may end in tokens that are not verified yet (a grammar's forced span): the index
    # follows them and rolls back when the committed tokens differ (_sync).
    drafts_past_unverified = True

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._levels = self.config.levels
        self._requests: dict[str, _RequestState] = {}
        # session_id -> indexes of finished turns, oldest first (LRU order over sessions).
        self._sessions: OrderedDict[str, list[SequenceIndex]] = OrderedDict()
        self.pool = SharedSuffixPool(self.config.pool) if self.config.pool is not None else None
        self._match_len: dict[str, int] = {}  # request -> its last proposal's longest match

    # -- Proposer hooks ----------------------------------------------------------------------

    def propose(self, contexts: Sequence[ProposalContext]) -> list[DraftTree | None]:
        return [self._propose_one(ctx) for ctx in contexts]

    def on_tokens_appended(self, request_id: str, session_id: str | None, token_ids: Sequence[int]) -> None:
        self._sync(request_id, session_id, token_ids)

    def on_request_finished(self, request_id: str) -> None:
        self._match_len.pop(request_id, None)
        state = self._requests.pop(request_id, None)
        if state is None or state.session_id is None:
            return
        history = self._sessions.setdefault(state.session_id, [])
        self._sessions.move_to_end(state.session_id)
        history.append(state.index)
        while sum(len(ix) for ix in history) > self.config.max_session_tokens and len(history) > 1:
            history.pop(0)
        while len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)

    def on_session_closed(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def learn_output(self, tenant: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """A finished request of `tenant`: its output joins the tenant's shared pool."""
        if self.pool is not None:
            self.pool.add(tenant, prompt, output)

    # -- internals ---------------------------------------------------------------------------

    def _sync(self, request_id: str, session_id: str | None, token_ids: Sequence[int]) -> SequenceIndex:
        """The request's index, caught up with token_ids (committed tokens only ever grow)."""
        state = self._requests.get(request_id)
        if state is None:
            state = _RequestState(session_id, self._adopt_or_new(session_id, token_ids))
            self._requests[request_id] = state
        index = state.index
        done = len(index)
        if done > len(token_ids) or (done and token_ids[done - 1] != index.tokens[-1]):
            done = _common_prefix(index.tokens, token_ids)  # history was rewritten: roll back
            index.truncate(done)
        if done < len(token_ids):
            index.extend(token_ids[done:])
        return index

    def _new_index(self) -> SequenceIndex:
        return SequenceIndex(self._levels, self.config.max_match)

    def _adopt_or_new(self, session_id: str | None, token_ids: Sequence[int]) -> SequenceIndex:
        # An agent's next turn usually re-sends the previous turn (prompt + answer) as the start
        # of its prompt, give or take a re-rendered end of turn: then take over that turn's
        # index, rolled back to the shared prefix, and only index the new tokens.
        history = self._sessions.get(session_id) if session_id is not None else None
        if history:
            shared = _common_prefix(history[-1].tokens, token_ids)
            if shared > 0 and 2 * shared >= len(history[-1]):
                index = history.pop()
                index.truncate(shared)
                return index
        return self._new_index()

    def _propose_one(self, ctx: ProposalContext) -> DraftTree | None:
        budget, cfg = ctx.max_draft_tokens, self.config
        if budget <= 0 or len(ctx.token_ids) < cfg.min_match:
            return None
        own = self._sync(ctx.request_id, ctx.session_id, ctx.token_ids)
        suffix = own.tokens[-cfg.max_match :]
        history = self._sessions.get(ctx.session_id, ()) if ctx.session_id is not None else ()
        sources = [own, *reversed(history)]  # priority order: own sequence, then newest turns
        sites: list[tuple[int, int, int]] = []  # (match_len, source rank, end)
        for rank, source in enumerate(sources):
            # A later source only helps with strictly longer matches once the list is full.
            min_len = cfg.min_match if len(sites) < cfg.max_sites else sites[cfg.max_sites - 1][0] + 1
            if min_len > cfg.max_match:
                break
            for length, end in source.find_sites(suffix, cfg.max_sites, cfg.max_chain, min_len):
                sites.append((length, rank, end))
            sites.sort(key=lambda s: (-s[0], s[1], -s[2]))
            del sites[cfg.max_sites :]
        # A site's weight doubles with every matched token: a longer shared context is a much
        # more specific predictor (measured on agent-style copy and tool-call traces).
        paths = [(2.0**length, _continuation(sources[rank].tokens, end, budget, rank == 0))
                 for length, rank, end in sites]
        if self.pool is not None and ctx.tenant is not None:
            paths += [(0.5 * 2.0 ** min(length, cfg.max_match), continuation)
                      for length, continuation in self.pool.drafts(ctx.tenant, own.tokens, budget)]
        self._match_len[ctx.request_id] = sites[0][0] if sites else 0
        if not paths:
            return None
        return _best_first_tree(suffix[-1], paths, budget, cfg.depth_decay)

    def last_match_len(self, request_id: str) -> int:
        """The longest suffix match of the request's last proposal (0: none, or only the
        shared pool's): how sure a copy is, for a proposer choosing between drafts."""
        return self._match_len.get(request_id, 0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by binary search over C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo + 1 < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def _continuation(tokens: list[int], end: int, length: int, is_own: bool) -> list[int]:
    """The `length` tokens that followed the site. In the request's own sequence the copy may
    overlap the text it predicts (as an LZ77 match does): if the text from `end` repeats from the
    current end, it repeats with period len - end, so a looping answer is continued past it."""
    out = tokens[end : end + length]
    if is_own and len(out) < length:
        period = tokens[end:]
        out = (period * (length // len(period) + 1))[:length]
    return out


def _best_first_tree(root_token: int, paths: list[tuple[float, list[int]]], budget: int,
                     depth_decay: float) -> DraftTree:
    """Merge weighted paths into a trie and keep the `budget` best nodes below the root.

    A node's score is the total weight of the sites passing through it times depth_decay^depth
    (a rough chance of being reached: even the right site's text drifts), so it never exceeds
    its parent's: taking nodes best first (shallower first on ties) keeps every kept node's
    parent, and orders siblings best first (the verifier tries them in that order)."""
    merged: dict[tuple[int, ...], float] = {}  # sites that continue alike count once, heavier
    for weight, path in paths:
        key = tuple(path)
        merged[key] = merged.get(key, 0.0) + weight
    if len(merged) == 1:  # one continuation (the common case): a chain, no trie needed
        return DraftTree.chain(root_token, next(iter(merged))[:budget])
    tokens, parents, weights, depths, kids = [root_token], [-1], [0.0], [0], [[]]
    children: dict[tuple[int, int], int] = {}  # (node, token) -> child
    for path, weight in merged.items():
        node, shared = 0, 0
        for token in path:
            child = children.get((node, token))
            if child is None:
                break
            weights[child] += weight
            node, shared = child, shared + 1
        for token in path[shared:]:  # past the shared prefix every node is new
            child = children[(node, token)] = len(tokens)
            tokens.append(token)
            parents.append(node)
            weights.append(weight)
            depths.append(depths[node] + 1)
            kids.append([])
            kids[node].append(child)
            node = child
    heap = [(-weights[c] * depth_decay ** depths[c], depths[c], c) for c in kids[0]]
    heapq.heapify(heap)
    new_index, out_tokens, out_parents = {0: 0}, [root_token], [-1]
    while heap and len(out_tokens) <= budget:
        _, _, node = heapq.heappop(heap)
        new_index[node] = len(out_tokens)
        out_tokens.append(tokens[node])
        out_parents.append(new_index[parents[node]])
        for c in kids[node]:
            heapq.heappush(heap, (-weights[c] * depth_decay ** depths[c], depths[c], c))
    return DraftTree(out_tokens, out_parents)


@register_proposer("ngram")
def _make_ngram(config: NgramConfig | None) -> NgramProposer:
    return NgramProposer(config)
