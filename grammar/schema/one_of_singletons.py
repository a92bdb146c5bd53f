"""`oneOf` branches that share only a trivial instance, made disjoint exactly (used by lower.py).

Many real `oneOf`s overlap in one value: `null` where two branches say `"type": ["object",
"null"]`, `[]` where every branch is an array of different items, `""` where one branch is
`{"enum": [""]}` and another any string. Such a value matches two branches, so the `oneOf`
rejects it; taking it out of every branch that accepts it changes no other instance's count of
matching branches, so the rewrite is exact, and the branches may then be provably disjoint
(check.py). Which branches accept the value is asked of `jsonschema` (lower.keep_valid).
"""

from __future__ import annotations

from typing import Any

from prescient.grammar.schema.merge import Unmergeable
from prescient.grammar.schema.nodes import without

# (value, the keyword that leaves it out, the type it has)
_SINGLETONS = ((None, None, "null"), ([], "minItems", "array"), ("", "minLength", "string"),
               ({}, "minProperties", "object"))


def shared_singletons(lw, node: dict, inlined: frozenset[str]) -> Any:
    """`node` with values two or more branches accept taken out of those branches; the node
    itself (same object) when there is none, Unmergeable when one cannot be taken out."""
    branches = node["oneOf"]
    out = list(branches)
    changed = False
    for value, keyword, json_type in _SINGLETONS:
        try:
            accepting = [i for i, b in enumerate(out) if b is not False and lw.keep_valid([value], b)]
            if len(accepting) < 2:
                continue
            stripped = [_without_value(lw.plain(out[i], inlined), value, keyword, json_type)
                        for i in accepting]
        except Unmergeable:
            continue  # this value stays shared; others may still be taken out
        for i, b in zip(accepting, stripped):
            out[i] = b
        changed = True
    if not changed:
        return node
    live = [b for b in out if b is not False]
    if not live:
        return False
    return {**without(node, "oneOf"), "oneOf": live}


def _without_value(branch: Any, value: Any, keyword: str | None, json_type: str) -> Any:
    """`branch` that no longer accepts `value` (and accepts everything else it did)."""
    if branch is True:
        branch = {}
    if not isinstance(branch, dict):
        raise Unmergeable("a branch that is not an object")
    for key in ("enum", "const"):
        if key in branch:
            values = branch["enum"] if key == "enum" else [branch["const"]]
            if not isinstance(values, list):
                raise Unmergeable("enum is not a list")
            kept = [v for v in values if not _same(v, value)]
            if not kept:
                return False
            return {**without(branch, "enum", "const"), "enum": kept}
    if keyword is None:  # null: only a type list can leave it out
        types = branch.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or "null" not in types:
            raise Unmergeable("null accepted without a type that names it")
        kept = [t for t in types if t != "null"]
        if not kept:
            return False
        return {**branch, "type": kept[0] if len(kept) == 1 else kept}
    current = branch.get(keyword, 0)
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise Unmergeable(f"'{keyword}' is not a number")
    return {**branch, keyword: max(1, int(current))}  # only the empty one has length 0


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
