"""`if`/`then`/`else` rewritten exactly into `anyOf` (used by lower.py; xgrammar ignores them).

An instance matches `{if: I, then: T, else: E}` when it matches (I and T) or (not I and E). The
rewrite needs `not I` in a positive form, which real schemas make easy: their `if` is almost
always "these properties have these values", `{properties: {k: S_k, ...}, required: R}` (an
absent k passes S_k). Then, a case split:

- I holds: I itself;
- I fails (an object: anything else passes I), one branch per way: some k present with a
  value S_k refuses (`not: S_k` beside k's schema, which not_rules.py and scalars.py turn
  positive for literals and types; a `not` they cannot write is refused by check_schema), or a
  name of R absent (`properties: {k: false}`).

Drafts 4 and 6 do not have these keywords (a validator ignores them): there they are dropped,
which is exact too. Any other `if` is left for check_schema to refuse.
"""

from __future__ import annotations

from typing import Any

from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable
from prescient.grammar.schema.nodes import typed_object, without

_BEFORE_IF = ("draft-03", "draft-04", "draft-06")
_KEYS = ("if", "then", "else")
_MAX_CASES = 4  # ways for an `if` to fail: one anyOf branch each


def if_then_else(lw, node: dict, inlined: frozenset[str]) -> Any:
    draft = lw.root.get("$schema")
    if isinstance(draft, str) and any(d in draft for d in _BEFORE_IF):
        return without(node, *_KEYS)  # not keywords of this draft: annotations
    rest = without(node, *_KEYS)
    if "if" not in node:  # then/else without if: no effect
        return rest
    cond = lw.plain(node["if"], inlined)
    if cond is True or cond == {}:
        return {"allOf": [rest, node.get("then", {})]}
    if cond is False:
        return {"allOf": [rest, node.get("else", {})]}
    props, required = _property_condition(cond)
    then, otherwise = node.get("then", {}), node.get("else", {})
    # I fails: a property of I present with a value its schema refuses (`not` beside the
    # property's own schema, for not_rules.py and scalars.py to write positively; check_schema
    # refuses a `not` they cannot), or a name I requires absent
    # (only an object can fail I: `properties` and `required` hold for every other instance)
    fails = [{"type": "object", "required": [name]} if sub is False else
             {"type": "object", "required": [name], "properties": {name: {"not": sub}}}
             for name, sub in props.items() if sub not in ({}, True)]
    own = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if not (typed_object(node) and name in own):  # (an object that has k: never absent)
            fails.append({"type": "object", "properties": {name: False}})
    branches = [{"allOf": [cond, then]}] + [{"allOf": [f, otherwise]} for f in fails]
    return {"allOf": [rest, {"anyOf": branches}]}


def _property_condition(cond: Any) -> tuple[dict, list]:
    """(k -> S_k, required names R) for an `if` of the form {properties: {k: S_k}, required: R}:
    it holds when every S_k holds on a present k and every name of R is present."""
    if not isinstance(cond, dict) or not set(cond) - ANNOTATIONS <= {"properties", "required"}:
        raise Unmergeable("an if other than properties and required names")
    props = cond.get("properties", {})
    required = cond.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list) or not all(
            isinstance(n, str) for n in required):
        raise Unmergeable("a malformed if")
    if len(props) + len(required) > _MAX_CASES:
        raise Unmergeable("an if on too many properties")
    return props, list(dict.fromkeys(required))
