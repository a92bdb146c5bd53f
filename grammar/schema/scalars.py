"""Rewrites of string and number keywords xgrammar would drop (used by lower.py).

Each function takes one schema node and returns the rewritten node, False when the node provably
accepts nothing, or raises Unmergeable when it cannot rewrite exactly (or narrower).
"""

from __future__ import annotations

import re
from typing import Any

from prescient.grammar.errors import GrammarError
from prescient.grammar.pattern import check_pattern
from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.product import anchors_inside
from prescient.grammar.schema.check import ASSERTIONS, STANDARD_FORMATS
from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable
from prescient.grammar.schema.regex_length import restrict_pattern

_ALL_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
# The shortest string xgrammar's grammar for a format accepts ("a@b", "a:").
_FORMAT_SHORTEST = {"email": 3, "uri": 2}
# Common addresses, at most 95 characters and at least 6 ("a@b.cc"): every match is an email.
EMAIL = (r"^[a-z0-9]{1,16}([._+-][a-z0-9]{1,16})?@[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?"
          r"(\.[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?){0,2}\.[a-z]{2,10}$")
_EMAIL_LENGTHS = (6, 95)
_STRING_ONLY = frozenset({"pattern", "minLength", "maxLength"})
_NUMBER_ONLY = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_OBJECT_ONLY = frozenset({"propertyNames", "minProperties", "maxProperties"})


def pattern_with_length(lw, node: dict) -> Any:
    """`pattern` next to minLength/maxLength: one pattern whose strings have those lengths
    (regex_length.py; exact, or narrower where it says so). False when no string of the
    pattern has such a length, on a node that can only be a string."""
    pattern = node["pattern"]
    if not isinstance(pattern, str):
        raise Unmergeable("pattern is not a string")
    low = _length(node, "minLength", 0)
    high = _length(node, "maxLength", 0) if "maxLength" in node else None
    out = restrict_pattern(pattern, low, high)
    if out is None:
        if node.get("type") in ("string", ["string"]):
            return False
        raise Unmergeable("no string of the pattern has the length (another type may match)")
    if not out.exact:
        lw.note("pattern+minLength/maxLength")
    rest = {k: v for k, v in node.items() if k not in ("pattern", "minLength", "maxLength")}
    return {**rest, "pattern": out.pattern}


def pattern_anchors(node: dict) -> Any:
    """A pattern with anchors inside groups (`(^a|^b)$`): the same pattern without them where
    whole-string matching makes them no-ops, or restated without a `$` that ends the string
    from inside (`(a($|/))*`; exact), else Unmergeable."""
    pattern = node["pattern"]
    try:
        check_pattern(pattern)
        return node
    except GrammarError as err:
        if err.feature != "pattern:anchor":
            return node
    try:
        out = restrict_pattern(pattern, 0, None)
    except Unmergeable:
        out = None
    if out is not None and out.exact:
        return {**node, "pattern": out.pattern}
    try:  # `$` inside (`(a($|/))*`): the pattern restated without it (regex/product.py)
        restated = anchors_inside(pattern)
    except (RegexUnsupported, RecursionError):
        raise Unmergeable("anchors that are not no-ops") from None
    if restated is None:
        raise Unmergeable("a pattern no string matches")  # (other types may match)
    return {**node, "pattern": restated}


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


def whole_step(node: dict) -> bool:
    """A whole-number `multipleOf` written as a float (3.0), or any whole one on numbers."""
    step = node.get("multipleOf")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 1:
        return False
    types = node.get("type")
    on_numbers = "number" in ([types] if isinstance(types, str) else list(types or []))
    return (isinstance(step, float) and step.is_integer()) or (isinstance(step, int) and on_numbers)


def integer_steps(node: dict) -> Any:
    """`multipleOf: 3.0` (or 3) on numbers: integers with a whole step. The same values (a
    multiple of 3 is an integer; 3.0 is written 3, the engine's one layout for a value);
    xgrammar enforces a whole-number step on integers, and 1 constrains none."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or not set(types) & {"number", "integer"}:
        raise Unmergeable("multipleOf on a non-numeric type")
    step = int(node["multipleOf"])
    rest = {k: v for k, v in node.items() if k != "multipleOf"}
    kept = list(dict.fromkeys("integer" if t == "number" else t for t in types))
    return {**rest, "type": kept[0] if len(kept) == 1 else kept,
            **({"multipleOf": step} if step != 1 else {})}


def format_with_length(node: dict) -> Any:
    """`format` next to minLength/maxLength: a minLength the format's own grammar already
    implies is dropped (exact); an email under a maxLength of 95 or more becomes a pattern of
    common addresses (narrower)."""
    fmt, lo = node.get("format"), _length(node, "minLength", 0)
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    if "maxLength" not in node and lo <= _FORMAT_SHORTEST.get(fmt, -1):
        return rest
    if fmt == "email" and lo <= _EMAIL_LENGTHS[0] and _length(node, "maxLength", 0) >= _EMAIL_LENGTHS[1]:
        return {**{k: v for k, v in rest.items() if k != "format"}, "pattern": EMAIL}
    raise Unmergeable(f"format {fmt!r} with a length")


def string_keywords_without_type(node: dict) -> bool:
    """pattern/minLength/maxLength, or a format JSON Schema defines, with no `type` (xgrammar
    ignores them there)."""
    keys = {k for k in node if k in _STRING_ONLY or k == "format" or k == "type"}
    asserting = keys & _STRING_ONLY or node.get("format") in STANDARD_FORMATS
    return "type" not in node and bool(asserting) and not (set(node) - keys - ANNOTATIONS) & ASSERTIONS


def number_keywords_without_type(node: dict) -> bool:
    """minimum/maximum/exclusive bounds/multipleOf with no `type` (xgrammar ignores them)."""
    keys = {k for k in node if k in _NUMBER_ONLY}
    return "type" not in node and bool(keys) and not (set(node) - keys - ANNOTATIONS) & ASSERTIONS


def object_keywords_without_type(node: dict) -> bool:
    """propertyNames/minProperties/maxProperties alone, with no `type` (xgrammar ignores them)."""
    keys = {k for k in node if k in _OBJECT_ONLY}
    return "type" not in node and bool(keys) and not (set(node) - keys - ANNOTATIONS) & ASSERTIONS



_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def integer_bounds_to_fix(node: dict) -> bool:
    """An integer node (no `number` beside it) bounded by a fraction or at or past the 64-bit
    range (xgrammar refuses both)."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if "integer" not in types or "number" in types:
        return False
    return any(_beyond(node.get(k)) or _fraction(node.get(k))
               for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _beyond(value: Any) -> bool:
    return _number(value) and not _INT64[0] < value < _INT64[1]


def _fraction(value: Any) -> bool:
    return isinstance(value, float) and not value.is_integer()


def integer_bounds(lw, node: dict) -> Any:
    """Integer bounds made whole (exact: an integer >= 1.5 is one >= 2) and clamped into the
    64-bit range: a maximum of 2**63 or more becomes 2**63 - 1 (narrower: larger integers are
    left out). A node whose integers all lie past that range is left for check_schema."""
    import math

    out = dict(node)
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        value = node.get(key)
        if not (_beyond(value) or _fraction(value)):
            continue
        low = key in ("minimum", "exclusiveMinimum")
        if (low and value >= _INT64[1]) or (not low and value <= _INT64[0]):
            raise Unmergeable("integers only outside the 64-bit range")
        del out[key]
        if _fraction(value):
            whole = math.ceil(value) if low else math.floor(value)
        else:  # past the range on the open side
            whole = int(value) + (1 if key == "exclusiveMinimum" else -1 if key == "exclusiveMaximum" else 0)
        if low:
            clamped = max(_INT64[0], whole)
            out["minimum"] = max(clamped, out.get("minimum", clamped))
        else:
            clamped = min(_INT64[1], whole)
            if clamped < whole:
                lw.note("integer bound past 64 bits")
            out["maximum"] = min(clamped, out.get("maximum", clamped))
    return out
