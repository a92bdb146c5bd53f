"""A parsed pattern (parser.py's tree) read the two ways the engine needs.

This engine's grammars match a pattern against the whole string, so `strip_anchors` drops the
anchors that are no-ops under that reading (a `^` only zero-width items can precede, a `$`
likewise at the end) and refuses any other. JSON Schema itself reads a pattern as a search;
`searching` writes that reading out as a tree, `[\\s\\S]*` on each unanchored side.
"""

from __future__ import annotations

from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import INF, lengths

_ANY = "[\\s\\S]"


def strip_anchors(node, first: bool, last: bool):
    """The tree without anchors that are no-ops under whole-string matching (a `^` that only
    zero-width items can precede, a `$` likewise at the end); RegexUnsupported for any other."""
    kind = node[0]
    if kind == "bol":
        if not first:
            raise RegexUnsupported("'^' inside the pattern")
        return ("cat", [])
    if kind == "eol":
        if not last:
            raise RegexUnsupported("'$' inside the pattern")
        return ("cat", [])
    if kind == "group":
        return ("group", strip_anchors(node[1], first, last))
    if kind == "alt":
        return ("alt", [strip_anchors(b, first, last) for b in node[1]])
    if kind == "rep":
        return ("rep", strip_anchors(node[1], False, False), node[2], node[3])
    if kind == "cat":
        items = node[1]
        lens = [lengths(x) for x in items]
        out = []
        for k, x in enumerate(items):
            before_empty = all(lens[j] == (0, 0) or items[j][0] in ("bol", "eol") for j in range(k))
            after_empty = all(lens[j] == (0, 0) or items[j][0] in ("bol", "eol")
                              for j in range(k + 1, len(items)))
            out.append(strip_anchors(x, first and before_empty, last and after_empty))
        return ("cat", out)
    return node


def searching(tree):
    """The pattern read as JSON Schema does (a search): each top-level alternative gets
    `[\\s\\S]*` on a side its anchor does not hold. None when every side is anchored."""
    branches = tree[1] if tree[0] == "alt" else [tree]
    out, changed = [], False
    for b in branches:
        items = b[1] if b[0] == "cat" else [b]
        anchored_start = bool(items) and _starts_anchored(items[0])
        anchored_end = bool(items) and _ends_anchored(items[-1])
        body = strip_anchors(b, True, True)
        parts = ([] if anchored_start else [("rep", ("char", _ANY), 0, INF)]) + [body] + (
            [] if anchored_end else [("rep", ("char", _ANY), 0, INF)])
        changed |= not (anchored_start and anchored_end)
        out.append(("cat", parts))
    if not changed:
        return None
    return out[0] if len(out) == 1 else ("alt", out)


def _starts_anchored(node) -> bool:
    if node[0] == "bol":
        return True
    if node[0] == "group":
        inner = node[1]
        if inner[0] == "alt":
            return all(_starts_anchored(b) for b in inner[1])
        return _starts_anchored(inner[1][0] if inner[0] == "cat" and inner[1] else inner)
    if node[0] == "cat" and node[1]:
        return _starts_anchored(node[1][0])
    return False


def _ends_anchored(node) -> bool:
    if node[0] == "eol":
        return True
    if node[0] == "group":
        inner = node[1]
        if inner[0] == "alt":
            return all(_ends_anchored(b) for b in inner[1])
        return _ends_anchored(inner[1][-1] if inner[0] == "cat" and inner[1] else inner)
    if node[0] == "cat" and node[1]:
        return _ends_anchored(node[1][-1])
    return False
