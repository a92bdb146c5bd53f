"""A prepared schema (GrammarCompiler.prepare_schema) said in the keywords llguidance implements.

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

One refusal of prescient's own: llguidance 1.9.1 lets the escapes `\"` and `\\` through a negated
class that excludes `"` or `\` (`^[^,"]+$` took `a\"b`, which decodes to `a"b`: an invalid output
found by `grammar-compliance --backend auto` on Github_medium), so a pattern with a negated class
that may exclude them goes to xgrammar.
"""

from __future__ import annotations

import re
from typing import Any

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
            raise GrammarError(f"llguidance would let an escaped quote or backslash through the negated class "
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
    try:
        compiled = re.compile(pattern)
    except re.error:
        return node
    declared = node.get("properties") or {}
    if any(compiled.search(name) for name in declared):
        return node
    rest = node.get("additionalProperties", True)
    out = {k: v for k, v in node.items() if k not in ("propertyNames", "additionalProperties")}
    out["patternProperties"] = {pattern: {} if rest is True else rest}
    out["additionalProperties"] = False
    return out


# In a negated class body: a quote, an escaped backslash, or an escape naming characters by code
# or by a class whose complement holds them (\x22, \u005c, \p{..}, \W, \D, \S: `[^\W]` excludes `"`).
_MAY_NAME_AN_ESCAPE = re.compile(r'"|\\\\|\\[xuWDSpP]')
_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")


def negation_may_exclude_an_escape(pattern: str) -> bool:
    """Whether a negated class `[^...]` of `pattern` may exclude `"` or `\\` (conservatively:
    any quote, backslash or code/class escape in its body counts)."""
    return any(_MAY_NAME_AN_ESCAPE.search(body) for body in _NEGATED_CLASS.findall(pattern))
