"""`uniqueItems: true` made exact where the arrays it allows are few enough to list (used by
lower.py; xgrammar ignores the keyword).

- arrays of at most one item (maxItems 0 or 1, or `items: false`) are all unique, and a node
  whose types exclude arrays has none: the keyword says nothing and is dropped;
- items of a few values (an enum or const, booleans, null, a short integer range, each kept
  only if the item schema accepts it) make finitely many unique arrays: the ordered
  selections of those values without repetition, minItems to maxItems long. Each is a tuple
  (`prefixItems` of consts, no item after them, all of them required), and the array is
  their `anyOf`; at most _MAX_ARRAYS of them (four values in every order and length are 65,
  five 326).

Anything else is left as it is (Unmergeable), for check_schema to refuse `uniqueItems` by name.
"""

from __future__ import annotations

import json
import math
from typing import Any

from prescient.grammar.schema.merge import ANNOTATIONS, Unmergeable
from prescient.grammar.schema.nodes import NON_ASSERTIONS, without

_MAX_ARRAYS = 512
_MAX_RANGE = 16  # integers of a range listed as values
_ARRAY_KEYS = frozenset({"type", "items", "minItems", "maxItems", "uniqueItems"})


def unique_items(lw, node: dict, inlined: frozenset[str]) -> Any:
    """`node` without `uniqueItems: true`, exact, or Unmergeable."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if isinstance(types, list) and "array" not in types:
        return without(node, "uniqueItems")  # a keyword of arrays: nothing else is one
    low = _count(node, "minItems", 0)
    high = _count(node, "maxItems", None)
    if high is not None and high <= 1:
        return without(node, "uniqueItems")  # one item cannot repeat
    items = lw.plain(node.get("items", {}), inlined)
    if items is False:
        return without(node, "uniqueItems")  # only [] is left
    # (without a type, `items` makes xgrammar produce arrays only: narrower, as everywhere)
    if types is None and "items" not in node:
        raise Unmergeable("uniqueItems on a node that may be something other than an array")
    others = [t for t in types or [] if t != "array"]  # other types: a branch of their own
    extra = [k for k in node if k not in _ARRAY_KEYS and k not in NON_ASSERTIONS]
    if extra:
        raise Unmergeable(f"uniqueItems beside {extra[0]!r}")
    values = _few_values(lw, items)
    if values is None:
        raise Unmergeable("uniqueItems over items that are not a few values")
    top = len(values) if high is None else min(high, len(values))
    if low > top and not others:
        return False  # more items than distinct values to fill them with
    count = sum(math.perm(len(values), n) for n in range(low, top + 1))
    if count > _MAX_ARRAYS:
        raise Unmergeable(f"uniqueItems: {count} arrays to list")
    branches = [_tuple(chosen) for n in range(low, top + 1) for chosen in _selections(values, n)]
    if others:
        branches.append({"type": others[0] if len(others) == 1 else others})
    notes = {k: v for k, v in node.items() if k in NON_ASSERTIONS}
    return {**notes, **branches[0]} if len(branches) == 1 else {**notes, "anyOf": branches}


def _count(node: dict, key: str, default):
    value = node.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise Unmergeable(f"'{key}' is not a count")
    return int(value)


def _few_values(lw, items: Any) -> list | None:
    """The distinct values an item may have, when the item schema lists few; else None."""
    if items is True or not isinstance(items, dict):
        return None
    keys = set(items) - ANNOTATIONS
    if "enum" in keys or "const" in keys:
        listed = items["enum"] if "enum" in items else [items["const"]]
        if not isinstance(listed, list):
            return None
        candidates = listed
    else:
        types = items.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:
            return None
        candidates = []
        for t in types:
            if t == "boolean":
                candidates += [False, True]
            elif t == "null":
                candidates.append(None)
            elif t == "integer" and isinstance(items.get("minimum"), int) and isinstance(
                    items.get("maximum"), int) and 0 <= items["maximum"] - items["minimum"] < _MAX_RANGE:
                candidates += list(range(items["minimum"], items["maximum"] + 1))
            else:
                return None  # strings, numbers, unbounded integers, arrays, objects: too many
    kept = lw.keep_valid(candidates, items)  # the item's other keywords judge each value
    distinct: dict[str, Any] = {}
    for value in kept:
        distinct.setdefault(_identity(value), value)
    return list(distinct.values())


def _identity(value: Any) -> str:
    """One text per JSON value as uniqueItems compares them (1 and 1.0 are one value; true and
    1 are two; key order does not count)."""
    return json.dumps(_normalized(value), sort_keys=True)


def _normalized(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items()}
    return value


def _selections(values: list, n: int):
    """Every ordered choice of n distinct values."""
    if n == 0:
        yield []
        return
    for i, v in enumerate(values):
        for rest in _selections(values[:i] + values[i + 1:], n - 1):
            yield [v, *rest]


def _tuple(chosen: list) -> dict:
    if not chosen:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "prefixItems": [{"const": v} for v in chosen], "items": False,
            "minItems": len(chosen)}
