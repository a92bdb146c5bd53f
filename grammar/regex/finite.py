"""Finite sets of strings against a pattern: the pattern's strings but a few, and all of a
pattern's strings when they are few.

Both read the pattern as this engine's grammars do (a whole-string match, parser.py's tree with
the no-op anchors dropped) and write the result back as pattern text that every reader here
reads the same way:

- `without_strings(p, names)`: a pattern whose whole-string matches are those of `p` (or of
  any of several patterns) except `names` (schema/not_rules.py for `not: {enum}` beside a pattern, schema/objects.py for the
  keys of a patternProperties pattern that are not declared names). Regular languages are
  closed under removing finitely many strings; the pattern is built by walking the names' trie
  through the pattern's partial derivatives (derivatives.py's linear forms): at each step a character
  class is split into the trie's next characters, which go on to the next trie node, and the
  rest of the class, which leaves the trie for good and keeps the pattern's continuation. A
  split class is written with explicit code points (`\\uXXXX`), as classes.py reads it (a
  shorthand as both dialects do), so the written pattern means what the engine generated from
  the original;
- `finite_strings(p, limit)`: every string of a pattern anchored at both ends with no
  unbounded repeat, when there are at most `limit`.

Both raise RegexUnsupported where they cannot answer exactly (the parser's refusals, a result
past its size limit, a character beyond the Basic Multilingual Plane that `\\u` cannot write).
"""

from __future__ import annotations

from prescient.grammar.regex.anchors import searching, strip_anchors
from prescient.grammar.regex.charset import LINE_TERMINATORS, subtract
from prescient.grammar.regex.derivatives import (
    EPS,
    alt,
    cat,
    class_text,
    code_text,
    frozen,
    leaf_set,
    linear,
    nullable,
    whole_tree,
    write,
)
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF, Parser

_END = None  # the trie's mark of a name ending here
_MAX_TEXT = 16384  # characters of a written pattern
_SHORTHANDS = frozenset("dDwWsS")


def without_strings(patterns: str | list[str], names: list[str], search: bool = False) -> str | None:
    """A pattern (anchored at both ends) whose whole-string matches are those of `patterns`
    (one, or the union of several) but `names`; None when no string is left. With `search`,
    the strings of `patterns` are those they are found in (JSON Schema's reading), not their
    whole-string matches (this engine's reading of a string's `pattern`)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    tree = alt([whole_tree(p, search) for p in patterns])
    if tree is None:
        return None
    trie: dict = {}
    for name in dict.fromkeys(names):
        node = trie
        for ch in name:
            if ord(ch) > 0xFFFF:
                raise RegexUnsupported("a name beyond the Basic Multilingual Plane")
            node = node.setdefault(ch, {})
        node[_END] = True
    out = _without(tree, trie) if trie else tree
    if out is None:
        return None
    text = f"^(?:{write(out)})$"
    if len(text) > _MAX_TEXT:
        raise RegexUnsupported("the pattern without those strings is too long")
    return text


def finite_strings(pattern: str, limit: int = 64) -> list[str] | None:
    """Every string `pattern` matches (it must be anchored at both ends, so that a search and a
    whole-string match agree), or None when they are more than `limit` or unbounded."""
    tree = Parser(pattern).parse()
    if searching(tree) is not None:
        return None  # an unanchored side: infinitely many strings match
    try:
        strings = _strings(frozen(strip_anchors(tree, True, True)), limit)
    except _TooMany:
        return None
    return sorted(strings)


def _holds(text: str, ch: str) -> bool:
    code = ord(ch)
    return any(low <= code <= high for low, high in leaf_set(text))


def _without(node, trie: dict):
    """A tree for the strings of `node` that are not words of `trie`; None when none is left."""
    parts = []
    if nullable(node) and _END not in trie:
        parts.append(EPS)
    pairs = linear(node)
    nexts = [c for c in trie if c is not _END]
    for text, cont in pairs:
        hit = [c for c in nexts if _holds(text, c)]
        leaf = _leaf_without(text, hit) if hit else text
        if leaf is not None:
            parts.append(cat([("char", leaf), cont]))
    for c in nexts:
        derivative = alt([cont for text, cont in pairs if _holds(text, c)])
        if derivative is not None:
            rest = _without(derivative, trie[c])
            if rest is not None:
                parts.append(cat([("char", _code(c)), rest]))
    return alt(parts)


def _leaf_without(text: str, chars: list[str]) -> str | None:
    """A leaf's text for its characters but `chars` (all of which it has); None when empty."""
    extra = "".join(_code(c) for c in chars)
    if text == ".":  # everything but the line terminators, and now `chars`
        ends = "".join(_code(chr(c)) for low, high in LINE_TERMINATORS for c in range(low, high + 1))
        return f"[^{ends}{extra}]"
    if len(text) == 2 and text[0] == "\\" and text[1] in _SHORTHANDS:
        # `[^\D...]`: inside a negated class a shorthand is read as either dialect does, so its
        # complement is what both agree on, as the bare shorthand is read
        return f"[^\\{text[1].swapcase()}{extra}]"
    if text.startswith("[^"):
        return text[:-1] + extra + "]"
    left = subtract(leaf_set(text), [(ord(c), ord(c)) for c in chars])
    return class_text(left) if left else None


def _code(ch: str) -> str:
    return code_text(ord(ch))


# --- enumeration ------------------------------------------------------------------------------


class _TooMany(Exception):
    pass


def _strings(node, limit: int) -> set[str]:
    kind = node[0]
    if kind == "char":
        ranges = leaf_set(node[1])
        if sum(high - low + 1 for low, high in ranges) > limit:
            raise _TooMany()
        return {chr(c) for low, high in ranges for c in range(low, high + 1)}
    if kind == "alt":
        out: set[str] = set()
        for x in node[1]:
            out |= _strings(x, limit)
            if len(out) > limit:
                raise _TooMany()
        return out
    if kind == "cat":
        out = {""}
        for x in node[1]:
            out = {a + b for a in out for b in _strings(x, limit)}
            if len(out) > limit:
                raise _TooMany()
        return out
    if kind == "rep":
        _, item, lo, hi = node
        if hi is INF:
            raise _TooMany()
        one = _strings(item, limit)
        out, level = set(), {""}
        for k in range(hi + 1):
            if k >= lo:
                out |= level
            if k < hi:
                level = {a + b for a in level for b in one}
            if len(out) > limit or len(level) > limit:
                raise _TooMany()
        return out
    raise RegexUnsupported(f"node {kind}")
