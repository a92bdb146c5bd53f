"""Rewrites of string and number keywords xgrammar would drop (used by lower.py).

Each function takes one schema node and returns the rewritten node, False when the node provably
accepts nothing, or raises Unmergeable when it cannot rewrite exactly (or narrower).
"""

from __future__ import annotations

import re
from typing import Any

from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable

# One atom (a class, a shorthand, a letter or digit) under one quantifier, anchored or not.
_REPEATED_ATOM = re.compile(
    r"^(\^?)(\[(?:\\.|[^\]\\])+\]|\\[wdsWDS]|[A-Za-z0-9])(\+|\*|\{(\d+)(,(\d*))?\})?(\$?)$")
_MAX_REPEAT = 512  # a longer bounded repeat makes a slow grammar
_ALL_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
# The shortest string xgrammar's grammar for a format accepts ("a@b", "a:").
_FORMAT_SHORTEST = {"email": 3, "uri": 2}
# Common addresses, at most 95 characters and at least 6 ("a@b.cc"): every match is an email.
_EMAIL = (r"^[a-z0-9]{1,16}([._+-][a-z0-9]{1,16})?@[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?"
          r"(\.[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?){0,2}\.[a-z]{2,10}$")
_EMAIL_LENGTHS = (6, 95)
_STRING_ONLY = frozenset({"pattern", "minLength", "maxLength"})


def pattern_with_length(node: dict) -> Any:
    """`pattern` repeating one atom plus minLength/maxLength: one pattern with the bounds in its
    quantifier. Exact where the engine already is: patterns match the whole string here (see
    check.py), narrower than JSON Schema's search for an unanchored pattern."""
    m = _REPEATED_ATOM.match(node["pattern"]) if isinstance(node["pattern"], str) else None
    if m is None:
        raise Unmergeable("pattern is not one repeated atom")
    start, atom, quant, low, comma, high, end = m.groups()
    lo, hi = {None: (1, 1), "+": (1, None), "*": (0, None)}.get(quant, (None, None))
    if low is not None:
        lo, hi = int(low), (None if comma is not None and high == "" else int(high or low))
    lo = max(lo, _length(node, "minLength", 0))
    if "maxLength" in node:
        cap = _length(node, "maxLength", 0)
        hi = cap if hi is None else min(hi, cap)
    if hi is not None and lo > hi:
        # only an anchored pattern on a string-only node is surely unsatisfiable; an unanchored
        # one may match inside a longer string, another type may match instead
        if start and end and node.get("type") in ("string", ["string"]):
            return False
        raise Unmergeable("length bounds outside the pattern's")
    if hi is not None and hi > _MAX_REPEAT:
        raise Unmergeable("bounded repeat too long")
    rest = {k: v for k, v in node.items() if k not in ("pattern", "minLength", "maxLength")}
    return {**rest, "pattern": f"^{atom}{{{lo},{'' if hi is None else hi}}}$"}


def _length(node: dict, key: str, default: int) -> int:
    value = node.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise Unmergeable(f"'{key}' is not a whole number")
    return int(value)


def not_type(node: dict) -> Any:
    """`not: {type: T}`: the node's types without T (a number excludes integers too)."""
    banned = node["not"]["type"]
    banned = {banned} if isinstance(banned, str) else set(banned)
    if not banned <= set(_ALL_TYPES):
        raise Unmergeable("unknown type under not")
    if "number" in banned:
        banned.add("integer")
    own = node.get("type", list(_ALL_TYPES))
    own = [own] if isinstance(own, str) else list(own)
    if "integer" in banned and "number" in own and "number" not in banned:
        raise Unmergeable("number without integers")
    kept = [t for t in own if t not in banned]
    if not kept:
        return False
    return {**{k: v for k, v in node.items() if k != "not"},
            "type": kept if len(kept) > 1 else kept[0]}


def whole_step(step: Any) -> bool:
    return isinstance(step, float) and step.is_integer() and step >= 1


def integer_steps(node: dict) -> Any:
    """`multipleOf: 3.0` on numbers: integers with a whole step (narrower: 3.0 itself is a
    multiple too); xgrammar enforces a whole-number step on integers, and 1 constrains none."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or not set(types) <= {"number", "integer"}:
        raise Unmergeable("multipleOf on a non-numeric type")
    step = int(node["multipleOf"])
    rest = {k: v for k, v in node.items() if k != "multipleOf"}
    return {**rest, "type": "integer", **({"multipleOf": step} if step != 1 else {})}


def format_with_length(node: dict) -> Any:
    """`format` next to minLength/maxLength: a minLength the format's own grammar already
    implies is dropped (exact); an email under a maxLength of 95 or more becomes a pattern of
    common addresses (narrower)."""
    fmt, lo = node.get("format"), _length(node, "minLength", 0)
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    if "maxLength" not in node and lo <= _FORMAT_SHORTEST.get(fmt, -1):
        return rest
    if fmt == "email" and lo <= _EMAIL_LENGTHS[0] and _length(node, "maxLength", 0) >= _EMAIL_LENGTHS[1]:
        return {**{k: v for k, v in rest.items() if k != "format"}, "pattern": _EMAIL}
    raise Unmergeable(f"format {fmt!r} with a length")


def string_keywords_without_type(node: dict) -> bool:
    """pattern/minLength/maxLength with no `type` (xgrammar ignores them there)."""
    keys = {k for k in node if k in _STRING_ONLY or k == "format" or k == "type"}
    return "type" not in node and bool(keys & _STRING_ONLY) and not (
        set(node) - keys - ANNOTATIONS)

