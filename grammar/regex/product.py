"""Two patterns as one: the strings both match, written as one pattern (schema/merge.py uses it
for `allOf` parts with different patterns).

Both are read as this engine's grammars read a pattern, a whole-string match (parser.py's tree,
no-op anchors dropped), or as JSON Schema does, a search (what a merge of two `pattern`s needs:
both must be found in the string). Their product automaton is built over partial derivatives
(derivatives.py's linear forms: a state is a pair of derivative trees, a move a pair of leaves whose characters
meet), pruned to the states that reach acceptance, and turned back into a pattern by state
elimination. A move's characters are written as explicit code points (`\\uXXXX`), or as the
complement of a few of them, as classes.py reads the leaves (shorthands as both dialects do),
so the pattern means what the engine would have generated for both.

`anchors_inside(p)` restates a pattern with `$` inside it (an end of the string reached from a
repeated part, which a grammar cannot say) as one without, from its own derivative automaton.
`without_matches(a, b)` is the other product schema/not_rules.py needs: the strings of `a` that
`b` is not found in (`not: {pattern: b}`), with b's side determinized.

RegexUnsupported where the parser does not read a pattern, the product has too many states, or
the written pattern is too long.
"""

from __future__ import annotations

from functools import lru_cache

from prescient.grammar.regex.charset import Ranges, complement, intersect, normalize
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF
from prescient.grammar.regex.derivatives import (
    EPS,
    alt,
    cat,
    class_text,
    ends_kept_tree,
    leaf_over,
    leaf_set,
    linear,
    nullable,
    whole_tree,
    write,
)

_MAX_STATES = 256
_MAX_TEXT = 8192


@lru_cache(maxsize=1024)  # a merge meets the same two patterns once per branch it distributes
def both(a: str, b: str, search: bool = False) -> str | None:
    """A pattern (anchored at both ends) for the whole strings both `a` and `b` match (with
    `search`, the strings both are found in, JSON Schema's reading); None when no string
    matches both."""
    start = (whole_tree(a, search), whole_tree(b, search))
    states = {start: 0}
    order = [start]
    moves: dict[int, list[tuple[Ranges, int]]] = {}
    k = 0
    while k < len(order):
        x, y = order[k]
        out = []
        for ta, ra in linear(x):
            for tb, rb in linear(y):
                chars = intersect(leaf_set(ta), leaf_set(tb))
                if not chars:
                    continue
                target = (ra, rb)
                if target not in states:
                    if len(states) >= _MAX_STATES:
                        raise RegexUnsupported("the two patterns' product has too many states")
                    states[target] = len(order)
                    order.append(target)
                out.append((chars, states[target]))
        moves[k] = out
        k += 1
    accepting = {i for i, (x, y) in enumerate(order) if nullable(x) and nullable(y)}
    live = _reaching(moves, accepting)
    if 0 not in live:
        return None
    tree = _eliminate(moves, accepting, live)
    text = f"^(?:{write(tree)})$"
    if len(text) > _MAX_TEXT:
        raise RegexUnsupported("the two patterns' intersection is too long to write")
    return text


@lru_cache(maxsize=256)
def anchors_inside(pattern: str) -> str | None:
    """`pattern` with `$` inside it (`(a($|/))*`: this part ends the string) written without
    anchors, by its own derivative automaton; None when it matches no string."""
    start = ends_kept_tree(pattern)
    states = {start: 0}
    order = [start]
    moves: dict[int, list[tuple[Ranges, int]]] = {}
    k = 0
    while k < len(order):
        out = []
        for text, cont in linear(order[k]):
            if cont not in states:
                if len(states) >= _MAX_STATES:
                    raise RegexUnsupported("the pattern has too many states")
                states[cont] = len(order)
                order.append(cont)
            out.append((leaf_set(text), states[cont]))
        moves[k] = out
        k += 1
    accepting = {i for i, x in enumerate(order) if nullable(x)}
    live = _reaching(moves, accepting)
    if 0 not in live:
        return None
    text = f"^(?:{write(_eliminate(moves, accepting, live))})$"
    if len(text) > _MAX_TEXT:
        raise RegexUnsupported("the pattern without its anchors is too long to write")
    return text


_ANY = ("rep", ("alt", (("char", "[^\\n]"), ("char", "\\n"))), 0, INF)  # every string


@lru_cache(maxsize=256)
def without_matches(a: str | None, b: str) -> str | None:
    """A pattern (anchored at both ends) for the whole strings of `a` (every string when None)
    that `b` is not found in (`not: {pattern: b}`); None when no string is left. The side of
    `b` is determinized (a state holds every derivative of b a prefix may have reached), so
    that "no derivative accepts" can be read off a state."""
    # b as either dialect may read it: its classes widened, and a match may end before a final
    # newline (Python's `$`)
    found = cat([whole_tree(b, search=True), ("rep", ("char", "\\n"), 0, 1)])
    start = (whole_tree(a) if a is not None else _ANY, frozenset([found]))
    states = {start: 0}
    order = [start]
    moves: dict[int, list[tuple[Ranges, int]]] = {}
    k = 0
    while k < len(order):
        x, bs = order[k]
        theirs = [pair for d in bs for pair in linear(d)]
        out = []
        for ta, ra in linear(x):
            for chars in _atoms(leaf_set(ta), [leaf_over(tb) for tb, _ in theirs]):
                target = (ra, frozenset(rb for tb, rb in theirs if intersect(chars, leaf_over(tb))))
                if target not in states:
                    if len(states) >= _MAX_STATES:
                        raise RegexUnsupported("the pattern without the other's matches has too many states")
                    states[target] = len(order)
                    order.append(target)
                out.append((chars, states[target]))
        moves[k] = out
        k += 1
    accepting = {i for i, (x, bs) in enumerate(order) if nullable(x) and not any(nullable(d) for d in bs)}
    live = _reaching(moves, accepting)
    if 0 not in live:
        return None
    text = f"^(?:{write(_eliminate(moves, accepting, live))})$"
    if len(text) > _MAX_TEXT:
        raise RegexUnsupported("the pattern without the other's matches is too long to write")
    return text


def _atoms(chars: Ranges, splits: list[Ranges]) -> list[Ranges]:
    """`chars` cut into pieces each inside or outside every set of `splits`."""
    pieces = [chars]
    for split in splits:
        cut = []
        for piece in pieces:
            inside, outside = intersect(piece, split), intersect(piece, complement(split))
            cut += [p for p in (inside, outside) if p]
        pieces = cut
        if len(pieces) > 64:
            raise RegexUnsupported("too many character classes to tell apart")
    return pieces


def _reaching(moves: dict, accepting: set[int]) -> set[int]:
    """The states from which an accepting state can be reached."""
    back: dict[int, set[int]] = {}
    for s, out in moves.items():
        for _, t in out:
            back.setdefault(t, set()).add(s)
    live, stack = set(accepting), list(accepting)
    while stack:
        for s in back.get(stack.pop(), ()):
            if s not in live:
                live.add(s)
                stack.append(s)
    return live


def _eliminate(moves: dict, accepting: set[int], live: set[int]):
    """State elimination: a tree for the paths from state 0 to acceptance."""
    start, final = -1, -2
    edges: dict[tuple[int, int], list] = {}

    def add(i: int, j: int, tree) -> None:
        edges.setdefault((i, j), []).append(tree)

    add(start, 0, EPS)
    for s in live:
        by_target: dict[int, list] = {}
        for chars, t in moves[s]:
            if t in live:
                by_target.setdefault(t, []).extend(chars)
        for t, chars in by_target.items():  # one class a move: the union of its leaves'
            add(s, t, ("char", class_text(normalize(chars))))
        if s in accepting:
            add(s, final, EPS)
    remaining = set(live)
    while remaining:
        # the state with the fewest edges first keeps the written pattern small
        degree: dict[int, int] = {}
        for i, j in edges:
            degree[i] = degree.get(i, 0) + 1
            degree[j] = degree.get(j, 0) + 1
        k = min(remaining, key=lambda s: degree.get(s, 0))
        remaining.discard(k)
        loop = alt(edges.pop((k, k), []))
        ins = [(i, alt(v)) for (i, j), v in list(edges.items()) if j == k]
        outs = [(j, alt(v)) for (i, j), v in list(edges.items()) if i == k]
        for key in [key for key in edges if k in key]:
            del edges[key]
        middle = [("rep", loop, 0, None)] if loop is not None else []
        for i, r_in in ins:
            for j, r_out in outs:
                add(i, j, cat([r_in, *middle, r_out]))
    return alt(edges.get((start, final), [])) or EPS
