"""`not` rewritten where its complement is expressible (used by lower.py and objects.py).

xgrammar ignores `not`. The forms real schemas use that have an exact positive form:

- `not` of required names, written `{required: N}`, `{allOf: [{required: A}, {required: B}]}`
  (one set: A and B), `{anyOf: [{required: A}, {required: B}]}` (each set on its own), with
  trivial `properties` ({} or true) beside `required`, or `type: object` on an object node:
  `required_sets` gives the sets, and objects.py leaves out one name of each;
- `not: {enum | const}` on a string without a pattern: a pattern matching every string but
  those (the complement of a finite set, built from the values' trie); on a string with a
  pattern no value matches (searched), the `not` is already implied and is dropped; with a
  pattern some value may match, the pattern's strings but those (regex/finite.py);
- `not: {enum | const}` on integers: the range cut around the values (`anyOf` of ranges);
- `not: {pattern: <one character or class>}` on a string without a pattern: no such
  character anywhere; any other `not: {pattern}` (beside a pattern or not): the strings the
  pattern under `not` is not found in, as one pattern (regex/product.py).

References under `not` are resolved first (lower.plain). Anything else is left for
check_schema to refuse.
"""

from __future__ import annotations

import math
import re
from typing import Any

from prescient.grammar.regex.anchors import strip_anchors
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.finite import without_strings
from prescient.grammar.regex.product import without_matches
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
        if types not in ("string", ["string"]):
            raise Unmergeable("not pattern on something other than strings")
        if "pattern" not in node:
            try:
                return {**rest, "pattern": _without_char(sub["pattern"])}
            except Unmergeable:
                pass  # the general product below
        own, theirs = node.get("pattern"), sub["pattern"]
        if not isinstance(theirs, str) or not isinstance(own, (str, type(None))):
            raise Unmergeable("pattern is not a string")
        try:  # the strings of the node's pattern the other is not found in (regex/product.py)
            left = without_matches(own, theirs)
        except RegexUnsupported as err:
            raise Unmergeable(str(err)) from None
        return False if left is None else {**rest, "pattern": left}
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
            if not isinstance(pattern, str):
                raise Unmergeable("pattern is not a string")
            try:  # the values the pattern may allow (Python's search holds the engine's reading)
                found = [v for v in strings if not v.isascii() or re.search(pattern, v)]
            except re.error:
                found = strings
            if not found:
                return rest  # the pattern already keeps the values out
            try:  # the pattern's strings but those (regex/finite.py)
                narrowed = without_strings(pattern, found)
            except RegexUnsupported as err:
                raise Unmergeable(str(err)) from None
            return False if narrowed is None else {**rest, "pattern": narrowed}
        if not strings:
            return rest
        return {**rest, "pattern": f"^{_except_strings(strings)}$"}
    if types in ("integer", ["integer"]):
        banned = sorted({int(v) for v in values if isinstance(v, (int, float))
                         and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer()})
        return _cut_range(rest, banned)
    raise Unmergeable("not enum on this type")


_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")


def not_values_by_type(lw, node: dict, inlined: frozenset[str]) -> Any:
    """`{type: T (or none), not: {enum | const}}` with nothing else beside: for each type of T,
    its values but the listed ones (exact), as an anyOf; Unmergeable where a type's rest is not
    expressible (an array or object literal other than [] or {})."""
    sub = lw.plain(node["not"], inlined)
    if not isinstance(sub, dict):
        raise Unmergeable("not of a boolean")
    keys = set(sub) - ANNOTATIONS
    values = _values(sub, keys)
    if "type" in sub:  # only the values of its types are excluded
        values = lw.keep_valid(values, {"type": sub["type"]})
    rest = without(node, "not")
    if set(rest) - ANNOTATIONS - {"type", "definitions", "$defs"}:
        raise Unmergeable("not of literals beside other keywords")
    types = rest.get("type", list(_TYPES))
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not set(types) <= set(_TYPES):
        raise Unmergeable("an unknown type")
    branches = []
    for t in dict.fromkeys(types):
        banned = lw.keep_valid(values, {"type": t})
        if not banned:
            branches.append({"type": t})
        elif t in ("string", "integer"):
            branches.append(not_literals(lw, {"type": t, "not": {"enum": banned}}, inlined))
        elif t == "number":
            branches += _cut_numbers(banned)
        elif t == "boolean":
            left = [b for b in (False, True) if not any(v is b for v in banned)]
            if left:
                branches.append({"enum": left})
        elif t == "array" and all(v == [] for v in banned):
            branches.append({"type": "array", "minItems": 1})
        elif t == "object" and all(v == {} for v in banned):
            branches.append({"type": "object", "minProperties": 1})
        elif t != "null":  # (null listed: no null is left)
            raise Unmergeable(f"not of {t} literals")
    branches = [b for b in branches if b is not False]
    notes = {k: v for k, v in rest.items() if k != "type"}
    if not branches:
        return False
    return {**notes, **branches[0]} if len(branches) == 1 else {**notes, "anyOf": branches}


def _cut_numbers(banned: list) -> list[dict]:
    """Numbers but the banned ones: the open intervals between them."""
    points = sorted({float(v) for v in banned if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(v)})
    if not points:
        return [{"type": "number"}]
    pieces = [{"type": "number", "exclusiveMaximum": _plain_number(points[0])}]
    for low, high in zip(points, points[1:]):
        pieces.append({"type": "number", "exclusiveMinimum": _plain_number(low),
                       "exclusiveMaximum": _plain_number(high)})
    pieces.append({"type": "number", "exclusiveMinimum": _plain_number(points[-1])})
    return pieces


def _plain_number(x: float) -> int | float:
    return int(x) if x.is_integer() else x


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
