"""Merge two JSON schemas into one that means `allOf: [a, b]`, or say it cannot.

xgrammar enforces `allOf` of one subschema only and ignores keywords written next to a
combinator or a `$ref`; lower.py rewrites those shapes into single schemas with this merge.
A merge is exact (the result accepts exactly what both accept) or it raises Unmergeable; it never
approximates. The result may be `False` (nothing satisfies both).

Keywords both sides carry: bounds tightened, `required` joined, two `pattern`s as the one
pattern of the strings both are found in (regex/product.py), two `not`s as one `not` of either,
two dependency maps joined; a key one side requires and the other forbids leaves no object, so
only the other types (or False). `$ref`s and combinators are not handled here: lower.py
resolves and distributes them before it merges, and rewrites two `if`s into their cases.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.product import both

_NUMBER_LOWS = ("minimum", "minLength", "minItems", "minProperties")
_NUMBER_HIGHS = ("maximum", "maxLength", "maxItems", "maxProperties")
# Keywords that must be equal when both sides carry them.
_EQUAL_ONLY = ("pattern", "format", "multipleOf", "prefixItems", "patternProperties", "not",
               "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas",
               "contains", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
               "$ref", "anyOf", "oneOf", "allOf")
_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
# Marks a `propertyNames` the lowering wrote for the keys beyond `properties` only (what xgrammar
# applies it to), so check_schema lets it stand beside declared names (objects.py). Its pattern
# leaves out every name declared then: one may be dropped (a false schema), none added (below).
# Here, not in nodes.py, since nodes imports this module.
OTHER_NAMES = "x-prescient-other-names"


def other_names(node: dict) -> bool:
    """Whether `node`'s propertyNames is one the lowering wrote (OTHER_NAMES)."""
    names = node.get("propertyNames")
    return isinstance(names, dict) and names.get(OTHER_NAMES) is True


class Unmergeable(Exception):
    """The two schemas have no single-schema intersection this module can write exactly."""


def merge(a: Any, b: Any, literal_filter: Callable[[list, dict], list] | None = None) -> Any:
    """One schema equal to allOf [a, b] (may be False); raises Unmergeable.

    `literal_filter(values, schema)` keeps the enum values that satisfy `schema`; it is needed
    only when one side lists literals and the other constrains more than their type.
    """
    if a is True or a == {}:
        return {} if b is True else b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise Unmergeable("a subschema is not an object")
    for x, y in ((a, b), (b, a)):
        if other_names(x) and set(y.get("properties") or {}) - set(x.get("properties") or {}):
            # the lowering's other keys may have that name: declaring it would let it in twice
            raise Unmergeable("a name declared beside keys the lowering wrote without it")
        if "$ref" in x and x != y and any(k not in ANNOTATIONS for k in y):
            # keywords written beside a `$ref` are ignored by drafts 4-7: the two stay apart,
            # for lower.py to resolve the reference and merge the target
            return {"allOf": [a, b]}
    if ("enum" in a or "const" in a) or ("enum" in b or "const" in b):
        return _merge_literals(a, b, literal_filter)
    for x, y in ((a, b), (b, a)):
        if any(x.get(k, True) is not True for k in ("unevaluatedProperties", "unevaluatedItems")):
            raise Unmergeable("unevaluated* sees only its own schema's keywords")
        # In one schema, additionalProperties skips names patternProperties match and `items`
        # skips the prefixItems positions; under allOf the other side's keyword covers them.
        if "patternProperties" in x and y.get("additionalProperties", True) is not True:
            raise Unmergeable("patternProperties against additionalProperties")
        if ("prefixItems" in x or isinstance(x.get("items"), list)) and \
                any(k in y for k in ("items", "prefixItems", "additionalItems")):
            raise Unmergeable("tuple items against items")
    out: dict = {}
    no_string = False
    for key in dict.fromkeys([*a, *b]):
        if key not in b:
            out[key] = a[key]
        elif key not in a:
            out[key] = b[key]
        elif a[key] == b[key]:
            out[key] = a[key]
        else:
            try:
                out[key] = _merge_key(key, a, b, literal_filter)
            except _NoString:
                no_string = True
    if no_string:  # no string matches both patterns: the other types the two allow
        out = _not_of_type(out, "string", _STRING_ONLY)
        if out is False:
            return False
    if "type" in out and out["type"] == []:
        return False
    if "properties" in a or "properties" in b:
        try:
            _merge_object_keys(a, b, out, literal_filter)
        except _NoObject:
            return not_an_object(out)
    return out


class _NoObject(Exception):
    """No object satisfies both sides (a key one requires, the other forbids)."""


# keywords that say something about objects only: meaningless once objects are ruled out
_OBJECT_ONLY = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                "minProperties", "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
                "unevaluatedProperties")


class _NoString(Exception):
    """No string satisfies both sides (two patterns no string matches)."""


_STRING_ONLY = ("pattern", "minLength", "maxLength", "format")


def not_an_object(out: dict) -> Any:
    """`out` for the instances that are not objects (what is left when no object satisfies it):
    its other types, False when it has none. (A side without a type lets non-objects through
    its object keywords, so they still match allOf of the two.)"""
    return _not_of_type(out, "object", _OBJECT_ONLY)


def _not_of_type(out: dict, kind: str, keywords: tuple) -> Any:
    types = out.get("type", sorted(_TYPES - {"integer"}))
    types = [types] if isinstance(types, str) else list(types)
    left = [t for t in types if t != kind]
    if not left:
        return False
    rest = {k: v for k, v in out.items() if k not in keywords}
    return {**rest, "type": left[0] if len(left) == 1 else left}


def _merge_key(key: str, a: dict, b: dict, literal_filter) -> Any:
    x, y = a[key], b[key]
    if key == "type":
        return _merge_types(x, y)
    if key in _NUMBER_LOWS:
        return max(x, y)
    if key in _NUMBER_HIGHS:
        return min(x, y)
    if key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(x, bool) or isinstance(y, bool):  # draft-4 flag form: depends on minimum
            raise Unmergeable(f"draft-4 '{key}'")
        return max(x, y) if key == "exclusiveMinimum" else min(x, y)
    if key == "required":
        return list(dict.fromkeys([*x, *y]))
    if key == "uniqueItems":
        return bool(x) or bool(y)
    if key in ("items", "additionalProperties", "propertyNames"):
        if isinstance(x, list) or isinstance(y, list):
            raise Unmergeable("tuple 'items'")
        return merge(x, y, literal_filter)
    if key == "properties":
        return x  # rebuilt by _merge_object_keys
    if key in ("definitions", "$defs"):
        if any(n in y and y[n] != v for n, v in x.items()):
            raise Unmergeable(f"two different '{key}' of one name")
        return {**x, **y}
    if key == "not":
        return _merge_nots(x, y)
    if key == "pattern" and isinstance(x, str) and isinstance(y, str):
        try:  # the strings both patterns are found in, as one pattern (regex/product.py)
            out = both(x, y, search=True)
        except RegexUnsupported as err:
            raise Unmergeable(f"two patterns: {err}") from None
        if out is None:
            raise _NoString()  # other types may still match
        return out
    if key in ("dependencies", "dependentRequired", "dependentSchemas") and isinstance(x, dict) and isinstance(y, dict):
        out = dict(x)
        for name, dep in y.items():
            if name not in out or out[name] == dep:
                out[name] = dep
            elif isinstance(out[name], list) and isinstance(dep, list):
                out[name] = list(dict.fromkeys([*out[name], *dep]))  # both sets of names needed
            elif isinstance(out[name], dict) and isinstance(dep, dict):
                out[name] = {"allOf": [out[name], dep]}  # both schemas apply
            else:
                raise Unmergeable(f"two forms of the dependency of {name!r}")
        return out
    if key in _EQUAL_ONLY:
        raise Unmergeable(f"two different '{key}'")
    return x  # annotations (title, description, ...): either one will do


def _merge_nots(x: Any, y: Any) -> Any:
    """`not: x` and `not: y` as one `not` (of either): one list of literals, one list of types,
    or their anyOf."""
    if isinstance(x, dict) and isinstance(y, dict):
        kx, ky = set(x) - ANNOTATIONS, set(y) - ANNOTATIONS
        if kx | ky <= {"enum", "const"} and len(kx) == len(ky) == 1 and all(
                isinstance(v, list) for v in (x.get("enum", []), y.get("enum", []))):
            return {"enum": [*(x["enum"] if "enum" in x else [x["const"]]),
                             *(y["enum"] if "enum" in y else [y["const"]])]}
        if kx == ky == {"type"}:
            tx, ty = ([t] if isinstance(t, str) else t for t in (x["type"], y["type"]))
            if isinstance(tx, list) and isinstance(ty, list):
                return {"type": list(dict.fromkeys([*tx, *ty]))}
    return {"anyOf": [x, y]}


def _merge_types(x: Any, y: Any) -> list[str]:
    xs = {x} if isinstance(x, str) else set(x)
    ys = {y} if isinstance(y, str) else set(y)
    if not (xs | ys) <= _TYPES:
        raise Unmergeable("unknown type")
    both = xs & ys
    # every integer is a number
    if "integer" in xs and "number" in ys or "number" in xs and "integer" in ys:
        both.add("integer")
    return sorted(both)


def _merge_object_keys(a: dict, b: dict, out: dict, literal_filter) -> None:
    """properties under allOf: a name declared on one side only still meets the other side's
    additionalProperties (when that side has one)."""
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    props = {}
    for name in dict.fromkeys([*pa, *pb]):
        sa = pa[name] if name in pa else a.get("additionalProperties", True)
        sb = pb[name] if name in pb else b.get("additionalProperties", True)
        props[name] = merge(sa, sb, literal_filter)
    required = set(out.get("required") or [])
    for name, sub in list(props.items()):
        if sub is False:
            if name in required:
                raise _NoObject(name)  # an object needs it and may not have it
            if out.get("additionalProperties", True) is not False:
                continue  # forbidden on an open object: lower.py's false-property rules take it
            del props[name]  # absent from a closed object: forbidden, as it should be
    out["properties"] = props


def _merge_literals(a: dict, b: dict, literal_filter) -> Any:
    """enum/const on either side: the listed values that satisfy both whole schemas."""
    values = None
    for side in (a, b):
        for key in ("enum", "const"):
            if key in side:
                these = side["enum"] if key == "enum" else [side["const"]]
                if not isinstance(these, list):
                    raise Unmergeable("'enum' is not a list")
                values = these if values is None else [v for v in values if _contains(these, v)]
    for side in (a, b):  # each side's other keywords judge the values on their own
        rest = {k: v for k, v in side.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
        if rest:
            if literal_filter is None:
                raise Unmergeable("literals next to other keywords")
            values = literal_filter(values, rest)
    if not values:
        return False
    keep = {k: v for k, v in {**b, **a}.items() if k in ANNOTATIONS}
    return {**keep, "enum": values}


ANNOTATIONS = frozenset({"title", "description", "default", "examples", "example", "$comment",
                          "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema"})


def _contains(values: list, value: Any) -> bool:
    return any(_json_equal(v, value) for v in values)


def _json_equal(x: Any, y: Any) -> bool:
    # JSON equality: 1 == 1.0 but True != 1
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return math.isclose(x, y, rel_tol=0, abs_tol=0)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_json_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_json_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y
