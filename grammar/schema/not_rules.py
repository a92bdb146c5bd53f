"""`not` rewritten where its complement is expressible (used by lower.py and objects.py).

xgrammar ignores `not`. The forms real schemas use that have an exact positive form:

- `not` of required names, written `{required: N}`, `{allOf: [{required: A}, {required: B}]}`
  (one set: A and B), `{anyOf: [{required: A}, {required: B}]}` (each set on its own), with
  trivial `properties` ({} or true) beside `required`, or `type: object` on an object node:
  `required_sets` gives the sets, and objects.py leaves out one name of each;
- `not: {enum | const}` on a string without a pattern: a pattern matching every string but
  those (the complement of a finite set, built from the values' trie); on a string with a
  pattern no value matches (searched), the `not` is already implied and is dropped;
- `not: {enum | const}` on integers: the range cut around the values (`anyOf` of ranges);
- `not: {pattern: <one character or class>}` on a string without a pattern: no such
  character anywhere.

References under `not` are resolved first (lower.plain). Anything else is left for
check_schema to refuse.
"""

from __future__ import annotations

import math
import re
from typing import Any

from prescient.grammar.regex.anchors import strip_anchors
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.parser import Parser
from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable
from prescient.grammar.schema.nodes import typed_object, without

_MAX_SETS = 4
_MAX_VALUES = 64


def required_sets(lw, node: dict, inlined: frozenset[str]) -> list[list[str]] | None:
    """The name sets an instance of `node` must not have all of (its `not`), or None when the
    `not` is not of that form."""
    if "not" not in node:
        return None
    try:
        sub = lw.plain(node["not"], inlined)
    except Unmergeable:
        return None
    sets = _sets(lw, sub, inlined, typed_object(node))
    return sets if sets and len(sets) <= _MAX_SETS else None


def _sets(lw, sub: Any, inlined: frozenset[str], on_objects: bool) -> list[list[str]] | None:
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - ANNOTATIONS
    if keys == {"allOf"} and isinstance(sub["allOf"], list):
        parts = [_sets(lw, lw.plain(p, inlined), inlined, on_objects) for p in sub["allOf"]]
        if not all(p is not None and len(p) == 1 for p in parts):
            return None
        return [list(dict.fromkeys(n for p in parts for n in p[0]))]
    if keys == {"anyOf"} and isinstance(sub["anyOf"], list):
        parts = [_sets(lw, lw.plain(p, inlined), inlined, on_objects) for p in sub["anyOf"]]
        if not all(p is not None for p in parts):
            return None
        return [s for p in parts for s in p]
    if "required" not in keys or not keys <= {"required", "properties", "type"}:
        return None
    required = sub["required"]
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        return None
    props = sub.get("properties", {})
    if not isinstance(props, dict) or any(v not in ({}, True) for v in props.values()):
        return None
    if "type" in sub and not (on_objects and sub["type"] in ("object", ["object"])):
        return None  # non-objects fail `type: object`: `not` would let them through
    return [required]


def not_literals(lw, node: dict, inlined: frozenset[str]) -> Any:
    """A string or integer node without `not: {enum | const | pattern}` (exact), or
    Unmergeable."""
    sub = lw.plain(node["not"], inlined)
    if not isinstance(sub, dict):
        raise Unmergeable("not of a boolean")
    keys = set(sub) - ANNOTATIONS
    types = node.get("type")
    rest = without(node, "not")
    if keys == {"pattern"} or keys == {"pattern", "type"} and sub.get("type") in ("string", ["string"]):
        if types not in ("string", ["string"]) or "pattern" in node:
            raise Unmergeable("not pattern beside a pattern")
        return {**rest, "pattern": _without_char(sub["pattern"])}
    values = _values(sub, keys)
    own = [types] if isinstance(types, str) else types
    theirs = sub.get("type")
    theirs = [theirs] if isinstance(theirs, str) else theirs
    if isinstance(own, list) and isinstance(theirs, list) and not (
            set(own) & set(theirs) or ("integer" in own and "number" in theirs)):
        return rest  # the node's instances all fail the type under `not`: it holds
    if types in ("string", ["string"]):
        strings = [v for v in values if isinstance(v, str)]
        if "pattern" in node:
            pattern = node["pattern"]
            if not all(v.isascii() for v in strings):
                raise Unmergeable("non-ASCII values beside a pattern")
            try:
                if any(re.search(pattern, v) for v in strings):
                    raise Unmergeable("a value the pattern allows")
            except re.error as err:
                raise Unmergeable(f"pattern: {err}") from None
            return rest  # the pattern already keeps the values out
        if not strings:
            return rest
        return {**rest, "pattern": f"^{_except_strings(strings)}$"}
    if types in ("integer", ["integer"]):
        banned = sorted({int(v) for v in values if isinstance(v, (int, float))
                         and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer()})
        return _cut_range(rest, banned)
    raise Unmergeable("not enum on this type")


def _values(sub: dict, keys: set) -> list:
    if keys == {"const"} or keys == {"const", "type"}:
        return [sub["const"]]
    if (keys == {"enum"} or keys == {"enum", "type"}) and isinstance(sub["enum"], list):
        if len(sub["enum"]) > _MAX_VALUES:
            raise Unmergeable("too many values under not")
        return sub["enum"]
    raise Unmergeable("not of something other than literals")


def _except_strings(values: list[str]) -> str:
    """A regex (no anchors) for every string but `values`."""
    trie: dict = {}
    for v in values:
        node = trie
        for ch in v:
            node = node.setdefault(ch, {})
        node[None] = True
    return _emit(trie)


def _emit(node: dict) -> str:
    """Strings that do not end at a word of the trie below `node`."""
    children = sorted(k for k in node if k is not None)
    parts = []
    if None in node:  # the empty suffix ends a value: at least one more character
        parts.append("[\\s\\S]+" if not children else "")
    else:
        parts.append("")  # the empty suffix is not a value
    for ch in children:
        parts.append(_escape(ch) + f"(?:{_emit(node[ch])})")
    if children:
        chars = "".join(_class_escape(c) for c in children)
        parts.append(f"[^{chars}][\\s\\S]*")
    alts = [p for p in parts if p != ""]
    if "" in parts and not (None in node and children):  # the empty suffix is in the complement
        return f"(?:{'|'.join(alts)})?"
    return "|".join(alts)


def _escape(ch: str) -> str:
    return "\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def _without_char(pattern: Any) -> str:
    """`^[^c]*$` for a searched pattern that is one character (class), else Unmergeable."""
    if not isinstance(pattern, str):
        raise Unmergeable("pattern is not a string")
    try:
        tree = strip_anchors(Parser(pattern).parse(), True, True)
    except RegexUnsupported as err:
        raise Unmergeable(str(err)) from None
    while tree[0] == "group":
        tree = tree[1]
    if tree[0] != "char" or pattern.startswith("^") or pattern.endswith("$"):
        raise Unmergeable("not of a pattern other than one character")
    text = tree[1]
    if text.startswith("[^") or text == "." or (text.startswith("\\") and text[1].isalpha()):
        raise Unmergeable("not of a negated or shorthand class")
    inner = text[1:-1] if text.startswith("[") else text
    return f"^[^{inner}]*$"


def _cut_range(node: dict, banned: list[int]) -> Any:
    low = node.get("minimum")
    high = node.get("maximum")
    if any(k in node for k in ("exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        raise Unmergeable("not enum beside exclusive bounds or a step")
    rest = {k: v for k, v in node.items() if k not in ("minimum", "maximum")}
    pieces = []
    start = low
    for v in banned:
        if (low is not None and v < low) or (high is not None and v > high):
            continue
        end = v - 1
        if start is None or end >= start:
            pieces.append((start, end))
        start = v + 1
    if high is None or start is None or start <= high:
        pieces.append((start, high))
    branches = [{**rest, **({"minimum": a} if a is not None else {}), **({"maximum": b} if b is not None else {})}
                for a, b in pieces]
    if not branches:
        return False
    return branches[0] if len(branches) == 1 else {"anyOf": branches}
