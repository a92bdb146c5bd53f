"""A `pattern` with nested repetition written as a DFA grammar, so a long match stays cheap.

xgrammar's regex converter keeps a pattern's nesting: `([/\\w .-]*)*` becomes
`r ::= "" | [..]* r`, and its matcher then carries every way of cutting the text into
iterations. Measured on the SmolLM2 vocabulary (Zen 5), one token's mask and advance took
2 ms after 10 tokens of a URL and 270 ms after 50 under the jsonschemabench pattern
`^(https?:\\/\\/)?([\\da-z\\.-]+)\\.([a-z\\.]{2,6})([\\/\\w \\.-]*)*\\/?$` (seconds a token
later: one schema's generation ran for minutes), `(\\w+\\s?)*` held 90 ms a token, and
`(?:\\S+\\s+){0,99}\\S+` 15 ms.

A pattern whose tree repeats something that holds a repeat or matches "" is therefore rebuilt
as its minimal DFA: Glushkov positions over code points (counted repeats expanded), subset
construction over the character ranges, Hopcroft's partition refinement, and one right-linear
rule per state (`s ::= [a-z] t | [./] s | e0 s | ""`), the characters JSON must escape
matched as their escapes (`e0 ::= ("\\\\n" | "\\\\u0001" | ...)`: json_escape.py, the ones
grammar/pattern.py writes). The matcher then holds one state: ~0.1 ms a token on all three.
Other patterns keep xgrammar's form, already cheap to match. A match is always the whole string
(anchors at the ends are no-ops). None means "use xgrammar's form": no nested repetition, an
automaton past the size caps, or syntax the parser here does not read (that form is correct,
only slower).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from prescient.grammar.regex.anchors import strip_anchors
from prescient.grammar.regex.charset import Ranges, intersect, subtract
from prescient.grammar.regex.classes import leaf_ranges
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.json_escape import UNSAFE, escape_text
from prescient.grammar.regex.parser import INF, Parser

MAX_POSITIONS = 4000  # Glushkov positions after expanding counted repeats
MAX_STATES = 1500  # DFA states before minimization
MAX_WORK = 300_000  # range visits while determinizing (~0.3 s): `\\W` alone is ~700 ranges
# Each state costs xgrammar ~4.5 ms of compile when its class spans most of Unicode (`\S`):
# `(?:\S+\s+){0,99}\S+` is 200 states, 1.0 s, against 4 ms for xgrammar's form, which matches
# at a flat ~15 ms a token. Past this many states, a nest of bounded repeats (per-token cost
# flat) keeps xgrammar's form; an unbounded one (cost growing with the string) never does.
MAX_BOUNDED_STATES = 64


class _TooBig(Exception):
    pass


def dfa_ebnf(pattern: str) -> str | None:
    """EBNF (`root ::= ...`, one rule per DFA state) matching the JSON text of a string body
    that `pattern` matches as a whole, or None when the pattern has no nested repetition, the
    automaton is too large, or the parser here does not read it."""
    try:
        tree = strip_anchors(Parser(pattern).parse(), True, True)
        if not _nested_repeat(tree):
            return None
        positions = _Positions()
        nullable, first, last = positions.build(tree)
        states, accepting = _determinize(positions, first, last, nullable)
    except (_TooBig, RegexUnsupported, RecursionError, IndexError, ValueError):
        return None
    start, blocks = _minimize(states, accepting)
    if start not in blocks:  # the pattern matches nothing (an empty class): xgrammar's form says so
        return None
    if len(blocks) > MAX_BOUNDED_STATES and not _nested_repeat(tree, unbounded=True):
        return None
    return _emit(start, blocks)


# --- which trees need it -----------------------------------------------------------------------


def _nested_repeat(node, unbounded: bool = False) -> bool:
    """Some repeat (more than once; with `unbounded`, without a bound) of an item that matches
    "" or holds a repeat itself."""
    kind = node[0]
    if kind == "group":
        return _nested_repeat(node[1], unbounded)
    if kind in ("cat", "alt"):
        return any(_nested_repeat(x, unbounded) for x in node[1])
    if kind == "rep":
        _, item, _lo, hi = node
        repeats = hi is INF or (hi > 1 and not unbounded)
        if repeats and (_matches_empty(item) or _has_repeat(item)):
            return True
        return _nested_repeat(item, unbounded)
    return False


def _has_repeat(node) -> bool:
    kind = node[0]
    if kind == "group":
        return _has_repeat(node[1])
    if kind in ("cat", "alt"):
        return any(_has_repeat(x) for x in node[1])
    if kind == "rep":
        return node[3] is INF or node[3] > 1 or _has_repeat(node[1])
    return False


def _matches_empty(node) -> bool:
    kind = node[0]
    if kind == "group":
        return _matches_empty(node[1])
    if kind == "cat":
        return all(_matches_empty(x) for x in node[1])
    if kind == "alt":
        return any(_matches_empty(x) for x in node[1])
    if kind == "rep":
        return node[2] == 0 or _matches_empty(node[1])
    return kind in ("bol", "eol")


# --- Glushkov positions --------------------------------------------------------------------------


class _Positions:
    """One position per character leaf visited (a counted repeat visits its item once per
    copy); `follow[p]`: the positions that may come right after p."""

    def __init__(self):
        self.ranges: list[Ranges] = []
        self.follow: list[set[int]] = []

    def _new(self, ranges: Ranges) -> int:
        if len(self.ranges) >= MAX_POSITIONS:
            raise _TooBig
        self.ranges.append(ranges)
        self.follow.append(set())
        return len(self.ranges) - 1

    def build(self, node) -> tuple[bool, set[int], set[int]]:
        """(matches "", first positions, last positions) of `node`, linking follow sets."""
        kind = node[0]
        if kind == "char":
            p = self._new(leaf_ranges(node[1]))
            return False, {p}, {p}
        if kind == "group":
            return self.build(node[1])
        if kind in ("bol", "eol"):
            return True, set(), set()
        if kind == "alt":
            parts = [self.build(x) for x in node[1]]
            return (any(n for n, _, _ in parts), set().union(*(f for _, f, _ in parts)),
                    set().union(*(l for _, _, l in parts)))
        if kind == "cat":
            return self._sequence(self.build(x) for x in node[1])
        _, item, lo, hi = node
        if max(lo, hi or 0) > MAX_POSITIONS:  # an item without positions would loop as long
            raise _TooBig
        copies = [self.build(item) for _ in range(lo)]
        if hi is INF:
            nullable, first, last = self.build(item)
            for p in last:
                self.follow[p] |= first
            copies.append((True, first, last))
        else:  # the optional copies nested, X(X(X)?)?)?: each copy links to the next only
            tail: tuple[bool, set[int], set[int]] = (True, set(), set())
            for _ in range(hi - lo):
                n, f, l = self.build(item)
                for p in l:
                    self.follow[p] |= tail[1]
                tail = (True, f | tail[1] if n else f, l | tail[2])
            copies.append(tail)
        return self._sequence(copies)

    def _sequence(self, parts) -> tuple[bool, set[int], set[int]]:
        nullable, first, last = True, set(), set()
        for n, f, l in parts:
            for p in last:
                self.follow[p] |= f
            first = first | f if nullable else first
            last = l | last if n else set(l)
            nullable = nullable and n
        return nullable, first, last


# --- subset construction and minimization ------------------------------------------------------


def _determinize(positions: _Positions, first: set[int], last: set[int], nullable: bool):
    """states[i]: [(low, high, target)] sorted by low; state 0 is the start."""
    start = frozenset({-1})  # before any character: followed by the first positions
    index = {start: 0}
    todo = [start]
    states: list[list[tuple[int, int, int]]] = []
    accepting: list[bool] = []
    budget = [MAX_WORK]
    while todo:
        current = todo.pop(0)
        nxt = first if current == start else set().union(*(positions.follow[p] for p in current))
        accepting.append(nullable if current == start else bool(current & last))
        moves = []
        for low, high, target in _split(nxt, positions.ranges, budget):
            if target not in index:
                if len(index) >= MAX_STATES:
                    raise _TooBig
                index[target] = len(index)
                todo.append(target)
            moves.append((low, high, index[target]))
        states.append(moves)
    return states, accepting


def _split(candidates: set[int], ranges: list[Ranges], budget: list[int]):
    """The character intervals on which the set of matching candidates is constant:
    [(low, high, frozenset of positions)], intervals no candidate matches left out."""
    cuts = sorted({b for q in candidates for low, high in ranges[q] for b in (low, high + 1)})
    members: list[set[int]] = [set() for _ in cuts]
    for q in candidates:
        for low, high in ranges[q]:
            span = range(bisect_right(cuts, low) - 1, bisect_right(cuts, high))
            budget[0] -= len(span) + 1
            if budget[0] < 0:
                raise _TooBig
            for k in span:
                members[k].add(q)
    out = []
    for k in range(len(cuts) - 1):
        if members[k]:
            out.append((cuts[k], cuts[k + 1] - 1, frozenset(members[k])))
    return out


def _minimize(states, accepting):
    """Hopcroft's refinement over the ranges' atoms: blocks of states no string tells apart;
    returns the start's block and {block: (accepting, transitions over blocks)}."""
    cuts = sorted({b for moves in states for low, high, _ in moves for b in (low, high + 1)})
    n, atoms = len(states), max(len(cuts) - 1, 0)
    dead = n  # where a character no transition takes leads: an extra, rejecting state
    inverse = [[[] for _ in range(n + 1)] for _ in range(atoms)]  # [atom][target] -> sources
    for source, moves in enumerate(states):
        covered = [False] * atoms
        for low, high, target in moves:
            for k in range(bisect_left(cuts, low), bisect_left(cuts, high + 1)):
                inverse[k][target].append(source)
                covered[k] = True
        for k in range(atoms):
            if not covered[k]:
                inverse[k][dead].append(source)
    for k in range(atoms):
        inverse[k][dead].append(dead)
    blocks = [b for b in ({s for s in range(n) if accepting[s]}, {s for s in range(n) if not accepting[s]} | {dead}) if b]
    block_of = [0] * (n + 1)
    for i, members in enumerate(blocks):
        for s in members:
            block_of[s] = i
    work = {(min(range(len(blocks)), key=lambda i: len(blocks[i])), k) for k in range(atoms)}
    while work:
        splitter, k = work.pop()
        into = {src for t in blocks[splitter] for src in inverse[k][t]}  # states whose atom k enters it
        touched: dict[int, set[int]] = {}
        for s in into:
            touched.setdefault(block_of[s], set()).add(s)
        for i, inside in touched.items():
            if len(inside) == len(blocks[i]):
                continue
            rest = blocks[i] - inside
            blocks[i] = inside
            blocks.append(rest)
            j = len(blocks) - 1
            for s in rest:
                block_of[s] = j
            for c in range(atoms):
                work.add((j, c) if (i, c) in work or len(rest) <= len(inside) else (i, c))
    out: dict[int, tuple] = {}
    for i, members in enumerate(blocks):
        if dead in members:  # states no string leads from to a match: rules never referenced
            continue
        s = next(iter(members))
        out[i] = (accepting[s], _merged((low, high, block_of[t]) for low, high, t in states[s]
                                        if block_of[t] != block_of[dead]))
    return block_of[0], out


def _merged(moves) -> tuple:
    out: list[list[int]] = []
    for low, high, target in moves:
        if out and out[-1][2] == target and out[-1][1] + 1 == low:
            out[-1][1] = high
        else:
            out.append([low, high, target])
    return tuple(map(tuple, out))


# --- EBNF ----------------------------------------------------------------------------------------


def _emit(start: int, blocks: dict[int, tuple]) -> str:
    """One rule per state, plus one per set of characters JSON escapes (`"`, `\\`, controls),
    written as their escapes the way grammar/pattern.py writes them (json_escape.py)."""

    def name(b: int) -> str:
        return "root" if b == start else f"s{b}"

    escapes: dict[tuple, str] = {}  # unsafe ranges -> the name of their rule
    lines = []
    for b in [start] + sorted(k for k in blocks if k != start):
        final, moves = blocks[b]
        by_target: dict[int, list[tuple[int, int]]] = {}
        for low, high, target in moves:
            by_target.setdefault(target, []).append((low, high))
        alternatives = []
        for target, ranges in by_target.items():
            if safe := subtract(ranges, UNSAFE):
                alternatives.append(f"[{''.join(_class_range(r) for r in safe)}] {name(target)}")
            if unsafe := tuple(intersect(ranges, UNSAFE)):
                alternatives.append(f"{escapes.setdefault(unsafe, f'e{len(escapes)}')} {name(target)}")
        if final:
            alternatives.append('""')
        lines.append(f"{name(b)} ::= ({' | '.join(alternatives)})")
    for unsafe, rule in escapes.items():
        texts = [_json_escape(code) for low, high in unsafe for code in range(low, high + 1)]
        lines.append(f"{rule} ::= ({' | '.join(texts)})")
    return "\n".join(lines) + "\n"


def _json_escape(code: int) -> str:
    """An EBNF literal of the JSON escape of `code` (a character JSON must escape)."""
    text = escape_text(code)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _class_range(r: tuple[int, int]) -> str:
    low, high = r
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _class_char(code: int) -> str:
    if 0x20 <= code < 0x7F:
        return "\\" + chr(code) if chr(code) in "]\\-^[" else chr(code)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
