"""A `pattern` intersected with minLength/maxLength, written as one pattern (used by scalars.py).

xgrammar ignores the length next to a pattern. The pattern is parsed into a small tree
(grammar/regex/parser.py: one character, concatenation, alternation, bounded repeat) and each
part is given the length budget its place allows:

- a part whose lengths already lie within its budget is kept as written;
- a repeat of a fixed-length item gets its count bounds from the budget (exact);
- a concatenation with one variable part hands that part what the fixed parts leave (exact);
- an alternation restricts each alternative (exact when each is);
- a concatenation with several variable parts, or a repeat of a variable-length item, splits the
  budget between them (narrower: `[a-z]+-[a-z]+` under maxLength 9 becomes
  `[a-z]{1,4}-[a-z]{1,4}`, which leaves out "ab-cdefgh").

Patterns match the whole string here, as everywhere in this engine (grammar/pattern.py); when the
whole-string reading leaves nothing, an unanchored side is read as JSON Schema's search instead
(`^a` with minLength 3 is `a[\\s\\S]{2,}`), so that only a truly empty intersection is called
unsatisfiable. Anchors at the ends of alternatives, inside groups too, are no-ops under whole-string
matching and are dropped (regex/anchors.py); the result is anchored at both ends. A pattern the
parser does not read is Unmergeable, as any rewrite this package cannot make.
"""

from __future__ import annotations

from dataclasses import dataclass

from prescient.grammar.regex.anchors import searching, strip_anchors
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF, Parser, lengths
from prescient.grammar.schema.merge import Unmergeable

_MAX_REPEAT = 1000  # a larger count bound makes a slow grammar: such budgets are split narrower


@dataclass(frozen=True)
class Restricted:
    pattern: str  # anchored at both ends
    exact: bool  # the intersection itself, not a narrower part of it
    searched: bool = False  # read as a search (the whole-string reading had no such length)


def restrict_pattern(pattern: str, low: int, high: int | None) -> Restricted | None:
    """The strings of `pattern` (whole-string) with length in [low, high], as one pattern;
    None when no string of the pattern (read as whole-string, then as search) has such a
    length. Raises Unmergeable for a pattern the parser does not read."""
    try:
        tree = Parser(pattern).parse()
        out = _restrict(strip_anchors(tree, True, True), low, high)
        searched = out is None
        if searched:
            tree = searching(tree)
            if tree is None:
                return None
            out = _restrict(tree, low, high)
            if out is None:
                return None
    except RegexUnsupported as err:
        raise Unmergeable(str(err)) from None
    node, exact = out
    return Restricted(f"^{_emit(node, top=True)}$", exact, searched)


# --- budgets --------------------------------------------------------------------------------


def _within(r, low: int, high: int | None) -> bool:
    return r[0] >= low and (high is INF or (r[1] is not INF and r[1] <= high))


def _misses(r, low: int, high: int | None) -> bool:
    return (high is not INF and r[0] > high) or (r[1] is not INF and r[1] < low)


def _restrict(node, low: int, high: int | None):
    """(node', exact) with node' within node and its lengths within [low, high], or None when
    no length of node lies there."""
    r = lengths(node)
    if _misses(r, low, high) or (high is not INF and low > high):
        return None
    if _within(r, low, high) and not _too_long(node):
        return node, True
    kind = node[0]
    if kind == "group":
        out = _restrict(node[1], low, high)
        return None if out is None else (("group", out[0]), out[1])
    if kind == "alt":
        kept = [_restrict(b, low, high) for b in node[1]]
        kept = [k for k in kept if k is not None]
        if not kept:
            return None
        return ("alt", [k[0] for k in kept]), all(k[1] for k in kept)
    if kind == "rep":
        return _restrict_rep(node, low, high)
    if kind == "cat":
        return _restrict_cat(node[1], low, high)
    return None


def _too_long(node) -> bool:
    """A counted repeat over _MAX_REPEAT (or an unbounded one, once bounded, would be)."""
    if node[0] == "rep":
        return (node[3] is not INF and node[3] > _MAX_REPEAT) or _too_long(node[1])
    if node[0] == "group":
        return _too_long(node[1])
    if node[0] in ("cat", "alt"):
        return any(_too_long(x) for x in node[1])
    return False


def _restrict_rep(node, low: int, high: int | None):
    _, item, lo, hi = node
    m, big = lengths(item)
    if m == big and m > 0:  # fixed-length item: the count carries the budget exactly
        new_lo = max(lo, -(-low // m))
        new_hi = hi if high is INF else (high // m if hi is INF else min(hi, high // m))
        if new_hi is not INF and new_lo > new_hi:
            return None  # no count gives a length in range
        exact = True
        if new_hi is not INF and new_hi > _MAX_REPEAT:
            if new_lo > _MAX_REPEAT:
                raise Unmergeable("repeat count too large")
            new_hi, exact = _MAX_REPEAT, False
        return ("rep", item, new_lo, new_hi), exact
    if hi == 1:  # optional: the item takes the whole budget (exact)
        if low == 0 and lo == 0:
            out = _restrict(item, 0, high)
            return (("cat", []), True) if out is None else (("rep", out[0], 0, 1), out[1])
        out = _restrict(item, low, high)
        return None if out is None else (out[0], out[1])
    # a variable item: split the budget between the count and the item (narrower)
    if high is INF:
        count_lo = max(lo, 1)
        item_lo = max(m, -(-low // count_lo))
        if big is not INF and item_lo > big:
            raise Unmergeable("budget split")
        return ("rep", _sub(item, item_lo, big), count_lo, hi), False
    count_hi = min(_MAX_REPEAT, high // max(m, 1), _MAX_REPEAT if hi is INF else hi)
    count_lo = max(lo, 1 if low > 0 else 0)
    if count_hi < max(count_lo, 1):
        raise Unmergeable("budget split")
    item_hi = high // count_hi if big is INF else min(big, high // count_hi)
    # every string needs count_lo items of item_lo characters at least: count_lo * item_lo >= low
    item_lo = max(m, -(-low // count_lo)) if count_lo else m
    if item_lo > item_hi:
        count_lo = max(count_lo, -(-low // max(item_hi, 1)))
        item_lo = max(m, -(-low // count_lo))
    if item_lo > item_hi or count_lo > count_hi or count_lo * item_lo < low:
        raise Unmergeable("budget split")
    return ("rep", _sub(item, item_lo, item_hi), count_lo, count_hi), False


def _sub(node, low: int, high: int | None):
    """A part restricted to a budget chosen by a split (so an empty result is no proof)."""
    out = _restrict(node, low, high)
    if out is None:
        raise Unmergeable("budget split left a part empty")
    return out[0]


def _restrict_cat(items: list, low: int, high: int | None):
    ranges = [lengths(x) for x in items]
    variable = [k for k, r in enumerate(ranges) if r[0] != r[1] or _too_long(items[k])]
    fixed = sum(r[0] for k, r in enumerate(ranges) if k not in variable)
    if len(variable) == 1:
        (k,) = variable
        sub = _restrict(items[k], max(0, low - fixed), INF if high is INF else high - fixed)
        if sub is None:
            return None  # exact: what the fixed parts leave is out of this part's reach
        return ("cat", [sub[0] if j == k else x for j, x in enumerate(items)]), sub[1]
    mins = {k: ranges[k][0] for k in variable}
    maxs = {k: ranges[k][1] for k in variable}
    if high is not INF:  # split what the minimums leave between the variable parts
        spare = high - fixed - sum(mins.values())
        caps = dict(mins)
        for share_round in range(2):
            open_parts = [k for k in variable if maxs[k] is INF or caps[k] < maxs[k]]
            if not open_parts or spare <= 0:
                break
            share = max(1, spare // len(open_parts)) if share_round == 0 else spare
            for k in open_parts:
                room = min(share, spare) if maxs[k] is INF else min(share, spare, maxs[k] - caps[k])
                caps[k] += room
                spare -= room
        maxs = caps
    need = low - fixed - sum(mins.values())
    for k in variable:  # raise minimums where there is room, first parts first
        if need <= 0:
            break
        room = need if maxs[k] is INF else min(need, maxs[k] - mins[k])
        mins[k] += room
        need -= room
    if need > 0:
        raise Unmergeable("budget split")
    return ("cat", [_sub(x, mins[k], maxs[k]) if k in variable else x
                    for k, x in enumerate(items)]), False


# --- back to a pattern ----------------------------------------------------------------------


def _emit(node, top: bool = False) -> str:
    kind = node[0]
    if kind == "char":
        return node[1]
    if kind in ("bol", "eol"):
        return ""
    if kind == "group":
        return _emit(node[1], top)
    if kind == "cat":
        return "".join(_emit_item(x) for x in node[1])
    if kind == "alt":
        body = "|".join(_emit(b) for b in node[1])
        return f"(?:{body})"
    return _emit_item(node)


def _emit_item(node) -> str:
    kind = node[0]
    if kind == "rep":
        _, item, lo, hi = node
        inner = _emit(item)
        if not (item[0] == "char" or (item[0] == "group" and item[1][0] == "alt")
                or item[0] == "alt"):
            inner = f"(?:{inner})"
        if hi == 0 or inner in ("", "(?:)"):
            return ""
        if (lo, hi) == (1, 1):
            return inner
        if hi is INF:
            quant = {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
        elif lo == hi:
            quant = f"{{{lo}}}"
        else:
            quant = "?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}"
        return inner + quant
    if kind == "cat":
        if not node[1]:
            return ""
        return f"(?:{_emit(node)})" if len(node[1]) != 1 else _emit_item(node[1][0])
    return _emit(node)
