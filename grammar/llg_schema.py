r"""A prepared schema (GrammarCompiler.prepare_schema) said in the keywords llguidance implements.

Two rewrites, each exact (the same set of instances), so `auto` keeps the cheap llguidance
compile for schemas it would otherwise hand to xgrammar (Github_hard: 60 + 45 of 116 fallbacks):
- `propertyNames: {pattern: P}` beside `additionalProperties: A` (what the lowering writes for the
  keys beyond `properties`, objects.py; or a schema's own on an object without properties) says:
  every undeclared key matches P and its value is A. llguidance has no propertyNames, but
  `patternProperties: {P: A}, additionalProperties: false` says the same, provided no declared
  name matches P (patternProperties would apply A to that name's value too): otherwise it stays.
- A `format` JSON Schema does not define is an annotation (check.py lets it pass; xgrammar ignores
  it); llguidance refuses names it does not know, so such formats are dropped.
Anything else is left as it is: llguidance refuses it by name and `auto` takes xgrammar.

One refusal of prescient's own: llguidance 1.9.1 lets the escapes `\"` and `\\` through a character
set that holds every control character but lacks `"` or `\` (`^[^,"]+$` took `a\"b`, which decodes
to `a"b`: an invalid output found by `grammar-compliance --backend auto` on Github_medium), so a
pattern with such a set goes to xgrammar (negation_may_exclude_an_escape).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

try:  # Python's regex parser: re._parser from 3.11, sre_parse before
    from re import _parser as _sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

from prescient.grammar.errors import GrammarError
from prescient.grammar.schema.check import STANDARD_FORMATS
from prescient.grammar.schema.merge import OTHER_NAMES

# Keywords whose value is one subschema / a list of them / a map from names to them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas", "dependencies")


def for_llguidance(node: Any) -> Any:
    """`node` with the rewrites above applied at every subschema (a new tree; `node` unchanged);
    GrammarError (feature "llguidance") where llguidance would not enforce a pattern exactly."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = for_llguidance(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [for_llguidance(v) for v in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):  # dependencies' list values (names) pass through
            out[key] = {name: for_llguidance(v) for name, v in out[key].items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt not in STANDARD_FORMATS:
        del out["format"]
    out = _names_as_pattern(out)
    for pattern in [out.get("pattern"), *(out.get("patternProperties") or {})]:
        if isinstance(pattern, str) and negation_may_exclude_an_escape(pattern):
            raise GrammarError(f"llguidance would let an escaped quote or backslash through a character set "
                               f"of pattern {pattern[:80]!r}", feature="llguidance")
    return out


def _names_as_pattern(node: dict) -> dict:
    names = node.get("propertyNames")
    if not isinstance(names, dict) or node.get("patternProperties"):
        return node
    if set(names) - {"type", "pattern", OTHER_NAMES} or names.get("type", "string") != "string":
        return node
    pattern = names.get("pattern")
    if not isinstance(pattern, str):
        return node
    compiled = _read_strictly(re.compile, pattern)
    if compiled is None:
        return node
    declared = node.get("properties") or {}
    if any(compiled.search(name) for name in declared):
        return node
    rest = node.get("additionalProperties", True)
    if rest is False:  # no other key at all: propertyNames says nothing more
        return {k: v for k, v in node.items() if k != "propertyNames"}
    out = {k: v for k, v in node.items() if k not in ("propertyNames", "additionalProperties")}
    out["patternProperties"] = {pattern: {} if rest is True else rest}
    out["additionalProperties"] = False
    return out


def negation_may_exclude_an_escape(pattern: str) -> bool:
    """Whether llguidance might let `\\"` or `\\\\` through `pattern` where they decode to a character
    it excludes. llguidance's regex engine quotes a character set that holds every control
    character (or all but newline) by allowing every JSON escape, whatever the set says of `"`
    and `\\`; so a set that holds those control characters but lacks `"` or `\\` is the case.
    Parsed with Python's regex parser (which reads `[^]"]` as JSON Schema's regexes do); syntax it
    may read differently (`[:`, `&&`, `--`, `~~`, `\\p`, `\\P`, `\\U`, nested classes) or cannot parse
    counts as such a set."""
    if any(token in pattern for token in _UNREAD) or "[" in _class_bodies(pattern):
        return True
    parsed = _read_strictly(_sre.parse, pattern)
    return parsed is None or any(_leaks(chars) for chars in _sets(parsed))


def _read_strictly(read, pattern: str):
    """`read(pattern)` (re.compile, the parser), or None where Python cannot read it or warns that
    it may read it otherwise than JSON Schema means ("possible nested set")."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return read(pattern)
    except (re.error, FutureWarning, DeprecationWarning, RecursionError):
        return None


_UNREAD = ("[:", "&&", "--", "~~", "\\p", "\\P", "\\U")
_CONTROL = frozenset(range(0x20))
_ESCAPED = (ord('"'), ord("\\"))
_PROBE = sorted(_CONTROL | set(_ESCAPED))
_CATEGORIES = {  # which probed characters each class escape holds (ASCII is all that is probed)
    "CATEGORY_DIGIT": frozenset(), "CATEGORY_NOT_DIGIT": frozenset(_PROBE),
    "CATEGORY_SPACE": frozenset(map(ord, "\t\n\v\f\r")),
    "CATEGORY_NOT_SPACE": frozenset(_PROBE) - frozenset(map(ord, "\t\n\v\f\r")),
    "CATEGORY_WORD": frozenset(), "CATEGORY_NOT_WORD": frozenset(_PROBE),
}


def _class_bodies(pattern: str) -> str:
    """The text inside [...] classes, roughly (only to spot a nested `[`)."""
    out, depth, i = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if depth:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":
            if depth:
                out.append(c)
            else:
                depth = 1
                i += 1
                if pattern[i:i + 1] == "^":
                    i += 1
                if pattern[i:i + 1] == "]":  # a leading ] is a literal
                    out.append("]")
                    i += 1
                continue
        elif c == "]" and depth:
            depth = 0
        elif depth:
            out.append(c)
        i += 1
    return "".join(out)


def _sets(parsed) -> list[frozenset]:
    """Of every character set in a parsed pattern (classes, negated literals, `.`), the probed
    characters it holds."""
    found: list[frozenset] = []

    def walk(node) -> None:
        if isinstance(node, _sre.SubPattern):
            for op, av in node:
                name = str(op)
                if name == "IN":
                    found.append(_holds(av))
                elif name == "NOT_LITERAL":
                    found.append(frozenset(_PROBE) - {av})
                elif name == "ANY":
                    found.append(frozenset(_PROBE) - {ord("\n")})
                else:
                    walk(av)
        elif isinstance(node, (tuple, list)):
            for item in node:
                walk(item)

    walk(parsed)
    return found


def _holds(items) -> frozenset:
    negate, held = False, set()
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            held.add(av)
        elif name == "RANGE":
            held.update(c for c in _PROBE if av[0] <= c <= av[1])
        elif name == "CATEGORY" and str(av) in _CATEGORIES:
            held.update(_CATEGORIES[str(av)])
        else:  # anything unforeseen: the worst case, negated or not (every control, no quote)
            return _CONTROL
    return frozenset(_PROBE) - held if negate else frozenset(held)


def _leaks(chars: frozenset) -> bool:
    controls = _CONTROL <= chars or (_CONTROL - {ord("\n")}) <= chars
    return controls and not all(c in chars for c in _ESCAPED)
