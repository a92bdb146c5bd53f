"""`oneOf` of object branches that may overlap, made into an `anyOf` of disjoint, narrower
branches (used by lower.py).

xgrammar enforces `oneOf` as `anyOf`; that is exact only when no instance matches two branches.
Each new branch i' accepts only instances of the original branch i that match no other original
branch j, so an output that matches i' matches exactly one original branch. i' excludes j by:
- requiring a property whose literal values differ between all branches (the discriminator);
- lacking a key j requires (i' is closed and drops the keys of R_j - R_i from its properties);
- requiring a key j cannot have (j closed by its author; `not: {required}` in j).
All reasoning about j uses the original branch j, never a narrowed one.
"""

from __future__ import annotations

from typing import Any

from prescient.grammar.schema.merge import Unmergeable
from prescient.grammar.schema.nodes import (
    COMBINATORS,
    combinator,
    forbids_undeclared,
    is_object,
    not_required,
    without,
)
from prescient.grammar.schema.objects import object_rules


def disjoint_one_of(lw, node: dict, inlined: frozenset[str], exact_only: bool) -> Any:
    """The rewritten node; with `exact_only`, only False (when the branches provably never
    match exactly one) or Unmergeable."""
    rest = without(node, "oneOf")
    originals, narrowed = [], []
    for b in node["oneOf"]:
        b = lw.plain(b, inlined)
        nb = object_rules(lw, b, inlined, exact_only) if isinstance(b, dict) and is_object(b) else b
        if nb is not False:  # a branch that never matches changes no count
            originals.append(b)
            narrowed.append(nb)
    if len(narrowed) < 2:
        if exact_only and narrowed:
            raise Unmergeable("one branch left: the walk below the oneOf rewrites it")
        return {**rest, **narrowed[0]} if narrowed else False
    if not all(isinstance(b, dict) and is_object(b) and not any(c in b for c in COMBINATORS)
               and lw.closed(b) for b in narrowed):
        raise Unmergeable("oneOf branches are not all closed objects")
    tag = _discriminator(originals)
    if tag is not None and all(tag in (b.get("properties") or {}) for b in narrowed):
        if any(tag not in (b.get("required") or []) for b in narrowed):
            lw.note("oneOf branches made disjoint")  # an optional tag made required
        return {**rest, "anyOf": [{**_require(b, tag), "type": "object"} for b in narrowed]}
    # branches equal but for `required`: R_j within R_i means i's instances all match j
    exact = all(without(b, "required") == without(originals[0], "required") for b in originals)
    if exact_only:
        if exact and all(any(set(o.get("required") or []) <= set(b.get("required") or [])
                             for j, o in enumerate(originals) if j != i)
                         for i, b in enumerate(originals)):
            return False  # every branch's instances all match another branch too
        raise Unmergeable("only an exact proof of unsatisfiability runs here")
    author_closed = [forbids_undeclared(b) for b in originals]
    out = []
    for i, b in enumerate(narrowed):
        own = _require_own_key(b, i, originals, author_closed)
        if own is not b:
            lw.note("oneOf branches made disjoint")  # an optional key made required
        b = own
        mine = set(b.get("required") or [])
        banned: set[str] | None = set()
        for j, other in enumerate(originals):
            if j == i:
                continue
            excluded = not_required(other)
            if excluded is not None and set(excluded) <= mine:
                continue  # j forbids having all of these
            if author_closed[j] and not mine <= set(other.get("properties") or {}):
                continue  # j cannot have a key i' requires
            extra = set(other.get("required") or []) - mine
            if not extra:
                banned = None  # every instance of i' may match j too: drop i
                break
            banned |= extra
        if banned is not None:
            if banned & set(b.get("properties") or {}):
                lw.note("oneOf branches made disjoint")  # declared keys left out
            props = {k: v for k, v in (b.get("properties") or {}).items() if k not in banned}
            # an object (narrower where the branch had no type: xgrammar makes it one anyway)
            out.append({**b, "type": "object", "properties": props, "additionalProperties": False})
    if not out:
        if exact:
            return False  # every branch's instances all match another branch too
        raise Unmergeable("no oneOf branch can be made disjoint")
    merged = combinator("anyOf", out)
    return {**rest, **merged}


def _require(b: dict, name: str) -> dict:
    return {**b, "required": list(dict.fromkeys([*(b.get("required") or []), name]))}


def _require_own_key(b: dict, i: int, originals: list[dict], author_closed: list[bool]) -> dict:
    """Branch i required to have a key no other branch may have, when there is one (narrower):
    then it matches no other branch. Only against branches their author closed."""
    if not all(c for j, c in enumerate(author_closed) if j != i):
        return b
    others = [set(o.get("properties") or {}) for j, o in enumerate(originals) if j != i]
    own = [k for k in (b.get("properties") or {}) if not any(k in o for o in others)]
    if not own or any(k in own for k in b.get("required") or []):
        return b
    return _require(b, own[0])


def _discriminator(branches: list[dict]) -> str | None:
    """A property every branch declares with literal values (enum/const), no value shared
    between two branches: requiring it makes the branches disjoint."""
    for name in (branches[0].get("properties") or {}):
        seen: list = []
        for b in branches:
            sub = (b.get("properties") or {}).get(name)
            values = sub.get("enum", [sub["const"]] if "const" in sub else None) \
                if isinstance(sub, dict) else None
            if not isinstance(values, list) or any(v in seen for v in values):
                break
            seen += values
        else:
            return name
    return None
