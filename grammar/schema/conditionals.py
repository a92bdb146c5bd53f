"""`if`/`then`/`else` rewritten exactly into `anyOf` (used by lower.py; xgrammar ignores them).

An instance matches `{if: I, then: T, else: E}` when it matches (I and T) or (not I and E). The
rewrite needs `not I` in a positive form, which real schemas make easy: their `if` is almost
always "property k has one of these values", `{properties: {k: {const: c}}}` (k absent passes
it too), with `required: [k]` or not. Then:

- I holds: `{properties: {k: {enum: V}}}` (and k required if I requires it);
- I fails: k present with a value outside V (`not: {enum: V}` beside k's schema, which
  not_rules.py turns positive), or, when I requires k, k absent (`properties: {k: false}`).

Drafts 4 and 6 do not have these keywords (a validator ignores them): there they are dropped,
which is exact too. Any other `if` is left for check_schema to refuse.
"""

from __future__ import annotations

from typing import Any

from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable
from prescient.grammar.schema.nodes import typed_object, without

_BEFORE_IF = ("draft-03", "draft-04", "draft-06")
_KEYS = ("if", "then", "else")


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
    name, values, required = _property_literals(cond)
    then, otherwise = node.get("then", {}), node.get("else", {})
    holds = {"properties": {name: {"enum": values}}, **({"required": [name]} if required else {})}
    fails = [{"required": [name], "properties": {name: {"not": {"enum": values}}}}]
    own = node.get("required") if isinstance(node.get("required"), list) else []
    if required and not (typed_object(node) and name in own):  # (an object that has k: never absent)
        fails.append({"properties": {name: False}})
    branches = [{"allOf": [holds, then]}] + [{"allOf": [f, otherwise]} for f in fails]
    return {"allOf": [rest, {"anyOf": branches}]}


def _property_literals(cond: Any) -> tuple[str, list, bool]:
    """(k, V, whether k is required) for an `if` of the form {properties: {k: {const|enum}}}."""
    if not isinstance(cond, dict) or not set(cond) - ANNOTATIONS <= {"properties", "required"}:
        raise Unmergeable("an if other than one property's values")
    props = cond.get("properties")
    if not isinstance(props, dict) or len(props) != 1:
        raise Unmergeable("an if on several properties")
    (name, sub), = props.items()
    if not isinstance(sub, dict) or not set(sub) - ANNOTATIONS <= {"const", "enum"} or len(
            set(sub) & {"const", "enum"}) != 1:
        raise Unmergeable("an if on something other than literals")
    values = [sub["const"]] if "const" in sub else sub["enum"]
    if not isinstance(values, list) or not values:
        raise Unmergeable("an if with no values")
    required = cond.get("required", [])
    if not isinstance(required, list) or not set(required) <= {name}:
        raise Unmergeable("an if requiring other names")
    return name, values, bool(required)
