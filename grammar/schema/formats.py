"""`format` next to minLength/maxLength or `pattern` (used by lower.py; xgrammar's format
grammars ignore both).

Exact rewrites, from facts about xgrammar's format grammars (tests/grammar/
test_grammar_schema_rules2.py pins them against xgrammar): none of the formats in _NONEMPTY
produces "", so a minLength of 1 says nothing more; uuid and date produce only strings of one
length; a pattern every string of the format's shape matches (the shape is a regex wider than
the format: `[0-9]{4}-[0-9]{2}-[0-9]{2}` for date) says nothing more either (regex_overlap.py
proves the inclusion); a format whose grammar is a regex (EXACT: uuid) and any pattern are the
one pattern of the format's values the pattern is found in (regex/product.py).

Narrower rewrites, where exact is impossible: the format replaced by a pattern of common
values of it (every match is a valid value: RFC 3986 URIs of the http(s) form, RFC 1123
hostnames, RFC 3339 date-times with days 01-28, regexes without metacharacters, ...), which regex_length.py can then intersect
with the lengths, and a `pattern` beside it kept only when the common values all match it.
"""

from __future__ import annotations

from typing import Any

from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.product import both
from prescient.grammar.schema.merge import Unmergeable
from prescient.grammar.schema.regex_overlap import within
from prescient.grammar.schema.scalars import EMAIL

# Formats whose xgrammar grammar never produces the empty string.
_NONEMPTY = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
                       "uri", "uuid", "relative-json-pointer"})
_FIXED = {"uuid": 36, "date": 10}
# Shapes: regexes every value xgrammar produces for the format matches.
_SHAPES = {
    "date": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$",
    "uuid": r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$",
}
# Formats whose xgrammar grammar is exactly this regex (tests/grammar/test_grammar_schema_rules3.py
# pins each against xgrammar): a pattern beside one is intersected with it (regex/product.py).
EXACT = {
    "uuid": _SHAPES["uuid"],
}
_LABEL = r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
_HOST = rf"{_LABEL}(\.{_LABEL}){{0,3}}"
_PATH = r"(/[A-Za-z0-9._~-]{1,24}){0,4}"
_DAY = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"
_CLOCK = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# Common values, most general first: every match is a valid value of the format.
_COMMON = {
    "uri": [rf"^https?://{_HOST}{_PATH}$", rf"^https://{_HOST}{_PATH}$", rf"^http://{_HOST}{_PATH}$",
            rf"^wss?://{_HOST}{_PATH}$"],
    "email": [EMAIL, r"^[a-z0-9]{1,16}(\.[a-z0-9]{1,16})?@[a-z0-9]{1,16}(\.[a-z0-9]{1,16}){0,2}\.[a-z]{2,10}$"],
    "hostname": [rf"^{_HOST}$"],
    "date-time": [rf"^{_DAY}T{_CLOCK}(\.[0-9]{{1,6}})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
                  rf"^{_DAY}T{_CLOCK}Z$"],
    "date": [rf"^{_DAY}$"],
    "ipv4": [rf"^({_OCTET}\.){{3}}{_OCTET}$"],
}
_COMMON["uri-reference"] = _COMMON["uri"]  # a URI is a URI reference
_COMMON["idn-hostname"] = _COMMON["hostname"]  # an ASCII hostname is an IDN hostname
_COMMON["idn-email"] = _COMMON["email"]
_COMMON["regex"] = [r"^[A-Za-z0-9 _-]*$"]  # no metacharacter: a regex matching itself
# Standard formats xgrammar does not enforce (check.py refuses them alone).
UNENFORCED = frozenset({"iri", "iri-reference", "idn-hostname", "idn-email", "regex"})
_COMMON["iri"] = _COMMON["uri"]
_COMMON["iri-reference"] = _COMMON["uri"]


def format_with_length(lw, node: dict, exact: bool) -> Any:
    """`format` beside minLength/maxLength (no pattern)."""
    fmt = node.get("format")
    low = _whole(node, "minLength", 0)
    high = _whole(node, "maxLength", None) if "maxLength" in node else None
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    if fmt in _FIXED and low <= _FIXED[fmt] and (high is None or high >= _FIXED[fmt]):
        return rest
    if high is None and low <= 1 and fmt in _NONEMPTY:
        return rest
    if exact or fmt not in _COMMON:
        raise Unmergeable(f"format {fmt!r} with a length")
    lw.note("format with a length (common values)")
    return {**{k: v for k, v in node.items() if k != "format"}, "pattern": _COMMON[fmt][0]}


def format_with_pattern(lw, node: dict, exact: bool) -> Any:
    """`format` beside `pattern` (lengths, if any, are left for the next rewrite)."""
    fmt, pattern = node.get("format"), node.get("pattern")
    if not isinstance(pattern, str):
        raise Unmergeable("pattern is not a string")
    if fmt in _SHAPES and within(_SHAPES[fmt], pattern):
        return {k: v for k, v in node.items() if k != "pattern"}  # every value matches it
    if fmt in EXACT:  # a regular format: its values the pattern is found in, as one pattern
        try:
            both_ = both(EXACT[fmt], pattern, search=True)
        except RegexUnsupported as err:
            raise Unmergeable(f"format {fmt!r} with a pattern: {err}") from None
        if both_ is None:
            raise Unmergeable(f"no {fmt} value matches the pattern")  # (other types may match)
        return {**{k: v for k, v in node.items() if k != "format"}, "pattern": both_}
    if not exact:
        for common in _COMMON.get(fmt, ()):
            if within(common, pattern):
                lw.note("format with a pattern (common values)")
                return {**{k: v for k, v in node.items() if k != "format"}, "pattern": common}
    raise Unmergeable(f"format {fmt!r} with a pattern")


def _whole(node: dict, key: str, default):
    value = node.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise Unmergeable(f"'{key}' is not a whole number")
    return int(value)


def unenforced_format(lw, node: dict, exact: bool) -> Any:
    """A format xgrammar would accept any string for, replaced by a pattern of common values
    (narrower)."""
    if exact:
        raise Unmergeable("a format xgrammar does not enforce")
    lw.note("unenforced format (common values)")
    return {**{k: v for k, v in node.items() if k != "format"}, "pattern": _COMMON[node["format"]][0]}
