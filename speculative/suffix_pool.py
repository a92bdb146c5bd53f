"""A shared suffix pool: recent outputs of one tenant's sessions, as suffix automata.

Agents of one tenant (one API key) share system prompts, tool schemas and answer shapes across
sessions, so one session's tool-call JSON predicts the next session's. The per-request and
per-session n-gram index (ngram.py) cannot see across sessions; this pool can. Each finished
request adds a short lead-in (the last prompt tokens: the template's turn header, so the first
output tokens have a context to match) and its output; a proposer asks for the continuations
of the longest suffix of its request's recent tokens found in the pool.

One generation is an online suffix automaton (Blumer et al.; the structure SuffixDecoding's
suffix trees and llama.cpp's hashed n-gram pool approximate) over the concatenated entries,
separated by a token no request contains, so matches never span two entries. Each state keeps
the end of its strings' first occurrence, so a match's continuation is read off the text.
Appending is amortized O(1) per token (at most 2 states and 3 transitions a token); a lookup
walks the query window once with suffix links.

An automaton cannot forget, so eviction is by generation: a tenant has a current and a closed
generation; the current one closes when it holds half the tenant's token budget or has been
open half the age limit, the closed one is dropped then, or once its first entry passes the age
limit. So no entry older than `max_age_s` is ever matched and a tenant holds at most
`max_tokens_per_tenant` tokens; tenants beyond `max_tenants` or the global token budget go least
recently used first. Tenants never share a generation: another tenant's text can never be
drafted, so nothing (drafts, `token_sources`, timing) reveals it.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

SEPARATOR = -1  # between entries; no request's tokens contain it


@dataclass(frozen=True)
class PoolConfig:
    max_tokens_per_tenant: int = 32768  # two generations of half this
    max_total_tokens: int = 131072  # over all tenants (measured ~0.37 KB a token: ~48 MiB at most)
    max_tenants: int = 64
    max_age_s: float = 3600.0
    lead_in: int = 8  # prompt tokens kept before each output
    window: int = 32  # query tokens matched (the longest suffix of these found in the pool)
    # Shorter matches draft nothing: a chat template's turn header plus a token or two says
    # little about the answer (at 4, measured: drafts displacing better ones on tool calls).
    min_match: int = 6
    # A continuation of a match of l tokens drafts at most ceil(draft_per_match * l) tokens:
    # the longer the shared context, the further the copy is trusted (SuffixDecoding's rule).
    draft_per_match: float = 1.5

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_tenant", "max_total_tokens", "max_tenants", "window", "min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lead_in < 0 or not self.max_age_s > 0 or not self.draft_per_match > 0:
            raise ValueError("lead_in must be >= 0, max_age_s and draft_per_match > 0")
        if self.max_total_tokens < self.max_tokens_per_tenant:
            raise ValueError("max_total_tokens must be >= max_tokens_per_tenant")


class SuffixAutomaton:
    """The suffix automaton of a growing token text (entries joined by SEPARATOR)."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self._next: list[dict[int, int]] = [{}]  # transitions per state; 0 = the empty string
        self._link = array("i", [-1])  # suffix link
        self._len = array("i", [0])  # longest string of the state
        self._end = array("i", [0])  # end (exclusive) of the first occurrence of its strings
        self._last = 0

    @property
    def num_states(self) -> int:
        return len(self._next)

    def add(self, tokens: Sequence[int]) -> None:
        """Append one entry (then a separator)."""
        for t in tokens:
            self._extend(t)
        self._extend(SEPARATOR)

    def _extend(self, token: int) -> None:
        nxt, link, length, end = self._next, self._link, self._len, self._end
        self.text.append(token)
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        end.append(len(self.text))
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q also stands for longer strings: split its short ones into a clone
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(end[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur

    def longest_match(self, window: Sequence[int]) -> tuple[int, int]:
        """(length, end) of the longest suffix of `window` that occurs in the text, `end` the
        exclusive end of its first occurrence; (0, 0) when none."""
        nxt, link, length = self._next, self._link, self._len
        state, matched = 0, 0
        for t in window:
            while state and t not in nxt[state]:
                state = link[state]
                matched = length[state]
            child = nxt[state].get(t)
            if child is None:
                state, matched = 0, 0
            else:
                state, matched = child, matched + 1
        return (matched, self._end[state]) if matched else (0, 0)

    def continuation(self, end: int, max_tokens: int) -> list[int]:
        """The tokens after `end`, up to the entry's end."""
        out = self.text[end:end + max_tokens]
        if SEPARATOR in out:
            out = out[:out.index(SEPARATOR)]
        return out


@dataclass
class _Generation:
    automaton: SuffixAutomaton
    opened: float  # when its first entry came

    @property
    def num_tokens(self) -> int:
        return len(self.automaton.text)


class _TenantPool:
    def __init__(self) -> None:
        self.generations: list[_Generation] = []  # oldest first, at most 2

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.generations)


class SharedSuffixPool:
    """Per-tenant pools of recent outputs (see the module docstring)."""

    def __init__(self, config: PoolConfig | None = None, clock=time.monotonic) -> None:
        self.config = config or PoolConfig()
        self.clock = clock
        self._tenants: OrderedDict[str, _TenantPool] = OrderedDict()  # least recently used first

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self._tenants.values())

    def tenants(self) -> list[str]:
        return list(self._tenants)

    def tenant_tokens(self, tenant: str) -> int:
        pool = self._tenants.get(tenant)
        return pool.num_tokens if pool else 0

    def num_states(self) -> int:
        return sum(g.automaton.num_states for p in self._tenants.values() for g in p.generations)

    def add(self, tenant: str, prompt_tail: Sequence[int], output: Sequence[int]) -> None:
        """Pool one finished request's output (with the last `lead_in` prompt tokens)."""
        cfg = self.config
        if not output:
            return
        entry = [*prompt_tail[len(prompt_tail) - min(cfg.lead_in, len(prompt_tail)):], *output]
        # An entry over half the tenant's budget keeps its end (the budget is a hard bound).
        entry = entry[-max(1, cfg.max_tokens_per_tenant // 2 - 1):]
        now = self.clock()
        self._expire(now)
        pool = self._tenants.get(tenant)
        if pool is None:
            pool = self._tenants[tenant] = _TenantPool()
        self._tenants.move_to_end(tenant)
        gens = pool.generations
        half = cfg.max_tokens_per_tenant // 2
        current = gens[-1] if gens else None
        if current is None or current.num_tokens + len(entry) + 1 > half or now - current.opened >= cfg.max_age_s / 2:
            gens.append(_Generation(SuffixAutomaton(), now))
            del gens[:-2]
        gens[-1].automaton.add(entry)
        self._fit_total(keep=tenant)

    def drafts(self, tenant: str, tokens: Sequence[int], budget: int) -> list[tuple[int, list[int]]]:
        """(match length, continuation) per generation whose longest match with the end of
        `tokens` reaches `min_match`, newest generation first; each continuation at most
        min(budget, ceil(draft_per_match * length)) tokens."""
        pool = self._tenants.get(tenant)
        if pool is None or budget <= 0:
            return []
        cfg = self.config
        self._expire(self.clock())
        if tenant not in self._tenants:
            return []
        window = tokens[len(tokens) - min(cfg.window, len(tokens)):]
        out = []
        for gen in reversed(pool.generations):
            length, end = gen.automaton.longest_match(window)
            if length < cfg.min_match:
                continue
            limit = min(budget, math.ceil(cfg.draft_per_match * length))
            continuation = gen.automaton.continuation(end, limit)
            if continuation:
                out.append((length, continuation))
        return out

    def clear(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._tenants.clear()
        else:
            self._tenants.pop(tenant, None)

    def _expire(self, now: float) -> None:
        limit = self.config.max_age_s
        for tenant in list(self._tenants):
            gens = self._tenants[tenant].generations
            gens[:] = [g for g in gens if now - g.opened < limit]
            if not gens:
                del self._tenants[tenant]

    def _fit_total(self, keep: str) -> None:
        cfg = self.config
        while len(self._tenants) > 1 and (len(self._tenants) > cfg.max_tenants
                                          or self.num_tokens > cfg.max_total_tokens):
            oldest = next(iter(self._tenants))
            if oldest == keep:
                break
            del self._tenants[oldest]
