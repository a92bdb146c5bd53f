"""Small helpers over JSON-schema nodes shared by lower.py and its rule modules."""

from __future__ import annotations

from typing import Any

from prescient.grammar.schema.merge import OTHER_NAMES, Unmergeable, other_names  # noqa: F401 (re-exported)

COMBINATORS = ("anyOf", "oneOf")
# Keywords whose values are instances, not subschemas: never walked as schemas.
VALUE_KEYS = frozenset({"enum", "const", "default", "examples", "example"})
NON_ASSERTIONS = frozenset({"title", "description", "default", "examples", "example", "$comment",
                            "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema",
                            "definitions", "$defs"})
MAX_BRANCHES = 64


def without(node: dict, *keys: str) -> dict:
    return {k: v for k, v in node.items() if k not in keys}


def assertions(node: dict, *exclude: str) -> list[str]:
    return [k for k in node if k not in exclude and k not in NON_ASSERTIONS]


def is_object(node: dict) -> bool:
    """An object node, by its `type` or, without one, by object keywords (xgrammar makes such a
    node an object; JSON Schema would let other types through, so rules that claim a node
    accepts nothing ask `typed_object` instead)."""
    t = node.get("type")
    if t is None:
        return "properties" in node or "required" in node or "patternProperties" in node
    return typed_object(node)


def typed_object(node: dict) -> bool:
    return node.get("type") in ("object", ["object"])


def forbids_undeclared(node: dict) -> bool:
    """The schema itself allows no key beyond `properties` (additionalProperties: false and no
    patternProperties to let others in)."""
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def combinator(comb: str, branches: list) -> Any:
    """`{comb: branches}` without the branches that never match (False); False when none is
    left, the branch itself when one is (for oneOf too: the others never match)."""
    live = [b for b in branches if b is not False]
    if not live:
        return False
    if len(live) > MAX_BRANCHES:
        raise Unmergeable("too many branches")
    return live[0] if len(live) == 1 else {comb: live}


def not_required(node: dict) -> list | None:
    """N of a `not: {required: N}` (nothing else under `not`), else None."""
    sub = node.get("not")
    if isinstance(sub, dict) and set(sub) == {"required"} and isinstance(sub["required"], list):
        return sub["required"]
    return None
