"""A pattern's tree taken apart one character at a time: partial derivatives (Antimirov's linear
forms), and the tree written back as pattern text (finite.py and product.py build on them).

A pattern is read once (parser.py), as a whole-string match (anchors.strip_anchors) or, when
asked, as JSON Schema's search (anchors.searching), into a hashable tree with capture groups
dropped. `linear(t)` lists (leaf, continuation) pairs: the non-empty strings of t are a
character of the leaf followed by a string of its continuation; `nullable(t)` says whether t
matches the empty string. Continuations are built by `cat`, which flattens, so the set of
derivatives of a tree stays finite (what a product automaton over them needs). A leaf keeps its
own text; `leaf_set` is its characters as classes.py reads them.
"""

from __future__ import annotations

from functools import lru_cache

from prescient.grammar.regex.anchors import searching, strip_anchors
from prescient.grammar.regex.charset import MAX_CHAR, Ranges, complement
from prescient.grammar.regex.classes import leaf_ranges
from prescient.grammar.regex.dialects import shorthand
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF, Parser, lengths

EPS = ("cat", ())  # the empty string
EOL = ("eol",)  # `$` inside a pattern: the string ends here


def whole_tree(pattern: str, search: bool = False):
    """The hashable tree of `pattern` read as a whole-string match, or with `search` as the
    strings it is found in."""
    tree = Parser(pattern).parse()
    found = searching(tree) if search else None
    return frozen(found if found is not None else strip_anchors(tree, True, True))


def ends_kept_tree(pattern: str):
    """The hashable whole-string tree of `pattern` with each `$` kept (EOL: the string ends
    there) and each `^` only zero-width items can precede dropped; RegexUnsupported for
    another `^`."""
    return _keep_ends(frozen(Parser(pattern).parse()), True)


def _keep_ends(node, first: bool):
    kind = node[0]
    if kind == "bol":
        if not first:
            raise RegexUnsupported("'^' inside the pattern")
        return EPS
    if kind == "alt":
        return ("alt", tuple(_keep_ends(x, first) for x in node[1]))
    if kind == "rep":
        return ("rep", _keep_ends(node[1], False), node[2], node[3])
    if kind == "cat":
        out, before = [], first
        for x in node[1]:
            out.append(_keep_ends(x, before))
            before = before and lengths(x) == (0, 0)
        return ("cat", tuple(out))
    return node


def frozen(node):
    """parser.py's tree with tuples for lists and without groups (they mean nothing to a match)."""
    kind = node[0]
    if kind in ("cat", "alt"):
        return (kind, tuple(frozen(x) for x in node[1]))
    if kind == "group":
        return frozen(node[1])
    if kind == "rep":
        return ("rep", frozen(node[1]), node[2], node[3])
    return node


def write(node) -> str:
    """Pattern text for a tree (leaves keep their own text)."""
    kind = node[0]
    if kind == "char":
        return node[1]
    if kind == "alt":
        return "|".join(write(x) for x in node[1])
    if kind == "cat":
        return "".join(f"(?:{write(x)})" if x[0] == "alt" else write(x) for x in node[1])
    if kind == "group":
        return f"(?:{write(node[1])})"
    if kind == "rep":
        _, item, lo, hi = node
        atom = item[1] if item[0] == "char" else f"(?:{write(item)})"
        if hi is INF:
            return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
        return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
    raise RegexUnsupported(f"node {kind}")


def cat(items) -> tuple:
    """The concatenation, flattened (EPS parts dropped)."""
    flat: list = []
    for x in items:
        if x[0] == "cat":
            flat += x[1]
        else:
            flat.append(x)
    return flat[0] if len(flat) == 1 else ("cat", tuple(flat))


def alt(items) -> tuple | None:
    """The alternation of distinct items; None for none (no string)."""
    items = list(dict.fromkeys(items))
    if not items:
        return None
    return items[0] if len(items) == 1 else ("alt", tuple(items))


@lru_cache(maxsize=8192)
def nullable(node) -> bool:
    """Whether `node` matches the empty string at the end of the string."""
    kind = node[0]
    if kind == "char":
        return False
    if kind == "eol":
        return True
    if kind == "cat":
        return all(nullable(x) for x in node[1])
    if kind == "alt":
        return any(nullable(x) for x in node[1])
    if kind == "rep":
        return node[2] == 0 or nullable(node[1])
    raise RegexUnsupported(f"node {kind}")


@lru_cache(maxsize=8192)
def empty(node) -> bool:
    """Whether `node` matches the empty string with more characters after it (an EOL does not)."""
    kind = node[0]
    if kind in ("char", "eol"):
        return False
    if kind == "cat":
        return all(empty(x) for x in node[1])
    if kind == "alt":
        return any(empty(x) for x in node[1])
    if kind == "rep":
        return node[2] == 0 or empty(node[1])
    raise RegexUnsupported(f"node {kind}")


@lru_cache(maxsize=8192)
def linear(node) -> tuple:
    """((leaf text, continuation), ...) for the non-empty strings of `node`."""
    kind = node[0]
    if kind == "char":
        return ((node[1], EPS),)
    if kind == "eol":
        return ()  # no character after the end
    if kind == "alt":
        return tuple(dict.fromkeys(pair for x in node[1] for pair in linear(x)))
    if kind == "cat":
        items = node[1]
        if not items:
            return ()
        head, tail = items[0], cat(items[1:]) if len(items) > 1 else EPS
        out = tuple((a, cat([r, tail])) for a, r in linear(head))
        return tuple(dict.fromkeys(out + (linear(tail) if empty(head) else ())))
    if kind == "rep":
        _, item, lo, hi = node
        if hi == 0:
            return ()
        # item{lo,hi} = item item{lo-1,hi-1}; a nullable item makes lo 0
        rest_lo = 0 if empty(item) else max(lo - 1, 0)
        rest = EPS if hi == 1 else ("rep", item, rest_lo, INF if hi is INF else hi - 1)
        return tuple(dict.fromkeys((a, cat([r, rest])) for a, r in linear(item)))
    raise RegexUnsupported(f"node {kind}")


@lru_cache(maxsize=4096)
def leaf_set(text: str) -> Ranges:
    """The code points a leaf matches (classes.py's reading: a shorthand as both dialects
    read it, what a string the engine generates may hold)."""
    return leaf_ranges(text)


@lru_cache(maxsize=4096)
def leaf_over(text: str) -> Ranges:
    """The code points a leaf may match in either dialect (what a pattern under `not` must be
    read as: a string either dialect finds it in is out)."""
    if text == ".":
        return complement([(0x0A, 0x0A)])  # Python's `.` leaves out only the newline
    if len(text) == 2 and text[0] == "\\" and text[1] in "dDwWsS":
        return shorthand(text[1], over=True)
    if text.startswith("[^"):  # the complement of what both dialects put in the listed part
        return complement(leaf_ranges("[" + text[2:]))
    if text.startswith("["):  # what either puts in it: the complement of the negated class
        return complement(leaf_ranges("[^" + text[1:]))
    return leaf_ranges(text)


def class_text(chars: Ranges) -> str:
    """Pattern text for a non-empty set of code points, as classes.py reads it back: listed as
    `\\uXXXX` ranges, or as the complement of a few, or every character."""
    if chars == [(0, MAX_CHAR)]:
        return "(?:[^\\n]|\\n)"
    if len(chars) == 1 and chars[0][0] == chars[0][1] and chr(chars[0][0]).isascii() and chr(chars[0][0]).isalnum():
        return chr(chars[0][0])
    if chars[-1][1] <= 0xFFFF:
        return "[" + "".join(_ranges_text(chars)) + "]"
    rest = complement(chars)
    if chars[-1][1] != MAX_CHAR or rest[-1][1] > 0xFFFF:
        raise RegexUnsupported("a class beyond the Basic Multilingual Plane")
    return "[^" + "".join(_ranges_text(rest)) + "]"


def code_text(code: int) -> str:
    """One code point as pattern text: itself when a letter or digit, else `\\uXXXX`."""
    ch = chr(code)
    if ch.isascii() and ch.isalnum():
        return ch
    if code > 0xFFFF:
        raise RegexUnsupported("a character beyond the Basic Multilingual Plane")
    return f"\\u{code:04x}"


def _ranges_text(chars: Ranges) -> list[str]:
    return [code_text(low) if low == high else f"{code_text(low)}-{code_text(high)}" for low, high in chars]
