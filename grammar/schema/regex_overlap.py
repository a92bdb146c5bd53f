"""Whether two `pattern`s can match one string (used by disjoint.py to tell oneOf branches apart).

A sound test, not a complete one: `disjoint(a, b)` is True only when no string that matches `a`
as a whole (what this engine's grammars produce: patterns match the whole string) is matched by
`b` read as JSON Schema reads it (a search: `b` anywhere in the string). False means "not proven".

Both patterns are parsed by grammar/regex/parser.py into a tree and built into NFAs over an
abstract alphabet: the 128 ASCII characters one by one, and one symbol standing for every
non-ASCII character. Every character set is widened to that alphabet (`\\d` and `\\w` also get
the non-ASCII symbol, as Python's `re` reads them in Unicode; a negated class gets it too), so a
set the abstraction says is empty really is: an empty product automaton proves the two languages
disjoint whichever regex dialect (ECMA-262, Python's) reads them.
"""

from __future__ import annotations

from functools import cache

from prescient.grammar.regex.anchors import searching, strip_anchors
from prescient.grammar.regex.dialects import shorthand
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF, Parser, lengths
from prescient.grammar.schema.merge import Unmergeable

_NON_ASCII = 128
_ALL = frozenset(range(129))
_ASCII = frozenset(range(128))
_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
_EVERYTHING = frozenset("[\\%s\\%s]" % pair for a, b in (("s", "S"), ("d", "D"), ("w", "W"))
                        for pair in ((a, b), (b, a)))
_MAX_STATES = 4000
_MAX_PAIRS = 200_000


def disjoint(a: str, b: str) -> bool:
    """No whole-string match of `a` is a (searched) match of `b`; False when not proven."""
    nfas = _automata(a, b, under=False)
    return nfas is not None and _empty_product(*nfas)


def within(a: str, b: str) -> bool:
    """Every whole-string match of `a` is a (searched) match of `b`; False when not proven."""
    nfas = _automata(a, b, under=True)
    return nfas is not None and _included(*nfas)


def _automata(a: str, b: str, under: bool):
    """NFAs of `a` read as a whole-string match and of `b` read as JSON Schema's search (its
    classes under-approximated with `under`); None when either cannot be built."""
    try:
        whole = strip_anchors(Parser(a).parse(), True, True)
        tree = Parser(b).parse()
        searched = searching(tree)
        nfa_a = _Nfa(whole)
        nfa_b = _Nfa(searched if searched is not None else strip_anchors(tree, True, True), under=under)
    except (RegexUnsupported, Unmergeable, RecursionError, IndexError, ValueError):
        return None
    return (nfa_a, nfa_b) if nfa_a.ok and nfa_b.ok else None


def pattern_lengths(pattern: str) -> tuple[int, int | None] | None:
    """(shortest, longest or None) of the whole-string matches of `pattern`; None when this
    parser does not read it."""
    try:
        return lengths(strip_anchors(Parser(pattern).parse(), True, True))
    except (RegexUnsupported, RecursionError, IndexError, ValueError):
        return None


def char_set(text: str, under: bool = False) -> frozenset[int]:
    """The abstract characters a one-character pattern fragment (`a`, `\\d`, `[^a-z]`, `.`) may
    match (a superset), or, with `under`, surely matches (a subset, ASCII only)."""
    if text == ".":
        return _ASCII - {0x0A, 0x0D} if under else _ALL
    if text in _EVERYTHING:
        return _ALL  # a class and its complement: every character in any reading
    if text.startswith("\\"):
        out = _escape(text[1:], under)
    elif text.startswith("["):
        out = _class(text[1:-1], under)
    else:
        out = _code(text)
    return out & _ASCII if under else out


@cache
def _shorthand(letter: str, under: bool) -> frozenset[int]:
    """regex/dialects.py's reading on the abstract alphabet: the over-approximation is every
    character either dialect puts in the class (non-ASCII ones as their one symbol); the
    under-approximation the ASCII characters both do."""
    ranges = shorthand(letter, over=not under)
    codes = {c for low, high in ranges for c in range(low, min(high, 127) + 1)}
    if not under and ranges and ranges[-1][1] >= 128:
        codes.add(_NON_ASCII)
    return frozenset(codes)


def _code(ch: str) -> frozenset[int]:
    return frozenset({ord(ch)}) if ord(ch) < 128 else frozenset({_NON_ASCII})


def _escape(body: str, under: bool = False) -> frozenset[int]:
    e = body[0]
    if e in "dDwWsS":
        return _shorthand(e, under)
    if e in _ESCAPES:
        return frozenset({_ESCAPES[e]})
    if e in "xu":
        return _code(chr(int(body[1:], 16)))
    return _code(e)  # an escaped punctuation character is itself


def _class(body: str, under: bool = False) -> frozenset[int]:
    negated = body.startswith("^")
    if negated:
        body = body[1:]
        inner = _class(body, False)  # what any reading may match; the rest surely is outside
        return _ASCII - inner if under else (_ALL - inner) | {_NON_ASCII}
    out: set[int] = set()
    i = 0
    items: list = []  # single codes (int) or sets
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            if e in "dDwWsS":
                items.append(_shorthand(e, under))
                i += 2
                continue
            if e in "xu":
                width = 2 if e == "x" else 4
                items.append(int(body[i + 2:i + 2 + width], 16))
                i += 2 + width
                continue
            if e == "b":
                items.append(0x08)
            else:
                items.append(_ESCAPES.get(e, ord(e)))
            i += 2
            continue
        items.append(ord(c))
        i += 1
    k = 0
    while k < len(items):
        x = items[k]
        if (isinstance(x, int) and k + 2 < len(items) and items[k + 1] == ord("-")
                and isinstance(items[k + 2], int)):
            lo, hi = x, items[k + 2]
            if lo > hi:
                raise ValueError("bad class range")
            out |= set(range(lo, min(hi, 127) + 1))
            if hi >= 128 and not under:
                out.add(_NON_ASCII)
            k += 3
            continue
        if isinstance(x, int):
            out |= _code(chr(x))
        else:
            out |= x
        k += 1
    return frozenset(out) & _ASCII if under else frozenset(out)


class _Nfa:
    """Thompson NFA: `edges[s]` is a list of (charset or None for epsilon, target)."""

    def __init__(self, tree, under: bool = False):
        self.under = under
        self.edges: list[list] = []
        self.ok = True
        try:
            self.start, self.accept = self._build(tree)
        except _TooBig:
            self.ok = False
            return
        self.closure = [self._eps(s) for s in range(len(self.edges))]

    def _state(self) -> int:
        if len(self.edges) >= _MAX_STATES:
            raise _TooBig()
        self.edges.append([])
        return len(self.edges) - 1

    def _build(self, node) -> tuple[int, int]:
        kind = node[0]
        s, t = self._state(), self._state()
        if kind == "char":
            self.edges[s].append((char_set(node[1], self.under), t))
        elif kind in ("bol", "eol"):
            raise Unmergeable("anchor inside")
        elif kind == "group":
            a, b = self._build(node[1])
            self.edges[s].append((None, a))
            self.edges[b].append((None, t))
        elif kind == "cat":
            cur = s
            for item in node[1]:
                a, b = self._build(item)
                self.edges[cur].append((None, a))
                cur = b
            self.edges[cur].append((None, t))
        elif kind == "alt":
            for item in node[1]:
                a, b = self._build(item)
                self.edges[s].append((None, a))
                self.edges[b].append((None, t))
        elif kind == "rep":
            _, item, lo, hi = node
            cur = s
            for _ in range(lo):
                a, b = self._build(item)
                self.edges[cur].append((None, a))
                cur = b
            if hi is INF:
                a, b = self._build(item)
                self.edges[cur].append((None, a))
                self.edges[b].append((None, cur))
            else:
                for _ in range(hi - lo):
                    a, b = self._build(item)
                    self.edges[cur].append((None, a))
                    self.edges[cur].append((None, t))
                    cur = b
            self.edges[cur].append((None, t))
        else:
            raise Unmergeable(f"node {kind}")
        return s, t

    def _eps(self, s: int) -> frozenset[int]:
        seen = {s}
        stack = [s]
        while stack:
            for label, target in self.edges[stack.pop()]:
                if label is None and target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)

    def moves(self, s: int):
        for label, target in self.edges[s]:
            if label is not None:
                yield label, target


class _TooBig(Exception):
    pass


def _empty_product(a: _Nfa, b: _Nfa) -> bool:
    start = (a.start, b.start)
    seen = {start}
    stack = [start]
    while stack:
        p, q = stack.pop()
        for x in a.closure[p]:
            for y in b.closure[q]:
                if x == a.accept and y == b.accept:
                    return False
                for label_x, tx in a.moves(x):
                    for label_y, ty in b.moves(y):
                        if label_x & label_y and (tx, ty) not in seen:
                            seen.add((tx, ty))
                            if len(seen) > _MAX_PAIRS:
                                return False
                            stack.append((tx, ty))
    return True


def _included(a: _Nfa, b: _Nfa) -> bool:
    """Every string `a` accepts, `b` accepts (b determinized on the fly)."""
    def step(states: frozenset[int], c: int) -> frozenset[int]:
        out: set[int] = set()
        for s in states:
            for label, target in b.moves(s):
                if c in label:
                    out |= b.closure[target]
        return frozenset(out)

    start = (a.start, b.closure[b.start])
    seen = {start}
    stack = [start]
    while stack:
        p, states = stack.pop()
        for x in a.closure[p]:
            if x == a.accept and b.accept not in states:
                return False
            for label, tx in a.moves(x):
                for c in label:
                    pair = (tx, step(states, c))
                    if pair not in seen:
                        seen.add(pair)
                        if len(seen) > _MAX_PAIRS // 10:
                            return False
                        stack.append(pair)
    return True
