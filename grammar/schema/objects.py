"""Object rewrites for lower.py: undeclared required names, false properties,
`not: {required}`, dependencies and patternProperties.

`lw` is the lower._Lowerer doing the walk (its merge, closed). `exact` is set below a
`oneOf`: a narrowing there could make two overlapping branches look disjoint, so only exact
rewrites run. A rule returns False only when no instance can match, whatever the types (a
`required` with no `type` lets non-objects through).
"""

from __future__ import annotations

import re
from typing import Any

from prescient.grammar.schema.merge import Unmergeable
from prescient.grammar.schema.not_rules import required_sets
from prescient.grammar.schema.merge import ANNOTATIONS
from prescient.grammar.schema.regex_overlap import disjoint as patterns_disjoint
from prescient.grammar.schema.regex_overlap import within
from prescient.grammar.schema.nodes import (
    combinator,
    typed_object,
    without,
)

_MAX_DEPENDENCY_BRANCHES = 3  # optional dependencies expanded: 2**3 anyOf branches at most


def object_rules(lw, node: dict, inlined: frozenset[str], exact: bool) -> Any:
    """One rewrite of an object node, or the node itself (same object) when none applies."""
    # dependencies first: they may declare names, and a name a false schema or `not` forbids
    # must be seen as such by the rules below, not redeclared after them
    for key in ("dependencies", "dependentRequired"):
        if node.get(key):
            if exact:
                raise Unmergeable("dependencies below a oneOf")
            return _dependencies(lw, node, key, inlined)
    props = dict(node.get("properties") or {})
    required = list(node.get("required") or [])
    ap = node.get("additionalProperties", True)
    out = dict(node)
    for name in (n for n in required if n not in props):
        sub = undeclared_schema(node, name)
        if sub is None:
            if typed_object(node):
                return False  # an object must have a key it may not have: none matches
            raise Unmergeable(f"required {name!r} is not allowed")  # check_schema names it
        props[name] = sub  # exact: the schema a key outside `properties` had
    falses = [n for n, v in props.items() if v is False]
    if falses and lw.closed({**out, "properties": props}):
        if any(n in required for n in falses):
            if typed_object(node):
                return False  # a required key whose schema is false
            raise Unmergeable("required key with schema false on a node without a type")
        props = {k: v for k, v in props.items() if v is not False}
        out["additionalProperties"] = False  # absent is the only way; keep it closed explicitly
    if props != (node.get("properties") or {}):
        out["properties"] = props
    sets = required_sets(lw, node, inlined)
    if sets is not None:
        if any(set(banned) <= set(required) for banned in sets):
            return False  # an object has them all; a non-object passes `required`: `not` fails
        if typed_object(node) and lw.closed(out):
            for banned in sets:
                if all(n in props for n in banned):
                    if exact:
                        raise Unmergeable("not-required narrowing below a oneOf")
                    # narrower: leave out one optional name, then it cannot have them all
                    lw.note("not required (a name left out)")
                    dropped = [n for n in banned if n not in required][-1]
                    props = {k: v for k, v in props.items() if k != dropped}
                    out["properties"] = props
                    out["additionalProperties"] = False
            out = without(out, "not")  # a closed object lacks one of each: `not` holds
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and patterns:
        return _pattern_properties(lw, out, patterns, inlined, exact)
    return out if out != node else node


def _dependencies(lw, node: dict, key: str, inlined: frozenset[str]) -> Any:
    """Rewrite the first entry of `dependencies`; the others stay for the next rewrite (of this
    node, or of each branch this one makes). Never claims unsatisfiable: `dependencies` is a
    draft-7 keyword that newer drafts ignore, so any such claim would depend on the draft."""
    deps = node[key]
    if not isinstance(deps, dict) or not lw.closed(node):
        raise Unmergeable("dependencies on an open object")
    (name, dep), *others = deps.items()
    props = dict(node.get("properties") or {})
    # declare every name a dependency needs, with the schema it had as an undeclared key, before
    # this rewrite closes the object explicitly (a name declared false stays false)
    for d in (d for v in deps.values() if isinstance(v, list) for d in v):
        if d not in props and undeclared_schema(node, d) is not None:
            props[d] = undeclared_schema(node, d)
    node = {**without(node, key), **({key: dict(others)} if others else {}),
            "properties": props, "additionalProperties": False}
    required = list(node.get("required") or [])
    if props.get(name, False) is False:
        return node  # the closed object never has it: the dependency never applies
    if isinstance(dep, list) and any(props.get(d, False) is False for d in dep):
        if name in required:
            raise Unmergeable(f"{name!r} needs a key the object cannot have")
        return {**node, "properties": without(props, name)}  # present is impossible: absent
    if name in required:
        return _with_dependency(lw, node, dep, inlined)
    optional = sum(1 for n in deps if props.get(n, False) is not False and n not in required)
    if optional > _MAX_DEPENDENCY_BRANCHES:
        raise Unmergeable("too many optional dependencies")
    present = _with_dependency(lw, {**node, "required": list(dict.fromkeys([*required, name]))},
                               dep, inlined)
    absent = {**node, "properties": without(props, name)}
    return combinator("anyOf", [present, absent])


def undeclared_schema(node: dict, name: str) -> Any:
    """The schema key `name` has when `properties` does not list it: {} where a
    patternProperties pattern matches it (the pattern rule merges its schema in later), else
    additionalProperties ({} when absent); None when the object forbids it."""
    for pattern in node.get("patternProperties") or {}:
        if not name.isascii():
            raise Unmergeable("a non-ASCII name (ECMA and Python classes differ)")
        try:
            if re.search(pattern, name):
                return {}
        except re.error as err:
            raise Unmergeable(f"pattern {pattern!r}: {err}") from None
    ap = node.get("additionalProperties", True)
    return None if ap is False else ap if isinstance(ap, dict) else {}


def _with_dependency(lw, node: dict, dep: Any, inlined: frozenset[str]) -> Any:
    if isinstance(dep, list):
        return {**node, "required": list(dict.fromkeys([*(node.get("required") or []), *dep]))}
    return lw.merge(node, dep, inlined)  # schema dependency


def _pattern_properties(lw, node: dict, patterns: dict, inlined: frozenset[str], exact: bool) -> Any:
    node = without(node, "patternProperties")
    props = node.get("properties") or {}
    if len(patterns) == 1 and not props:
        (pattern, sub), = patterns.items()
        if isinstance(pattern, str) and within(r"^[\s\S]*$", pattern):
            return {**node, "additionalProperties": sub}  # every name matches: exact
    if not props:
        names = node.get("propertyNames")
        if names is not None and not (len(patterns) == 1 and isinstance(names, dict) and
                                      names.get("pattern") == next(iter(patterns))
                                      and set(names) - ANNOTATIONS <= {"pattern", "type"}):
            raise Unmergeable("patternProperties beside propertyNames")
        (pattern, sub), *others = patterns.items()
        if exact and (others or node.get("additionalProperties") is not False):
            raise Unmergeable("narrower patternProperties below a oneOf")
        if others:
            # narrower: only names of one pattern whose names no other pattern matches
            pattern, sub = _pattern_apart(patterns)
            lw.note("patternProperties (one pattern's names)")
        elif node.get("additionalProperties") is not False:
            lw.note("patternProperties (only matching names)")
        # exact when other names were forbidden; else narrower (only matching names)
        # (names are strings: the type says nothing more, and keeps the pattern enforced)
        return {**node, "propertyNames": {"type": "string", "pattern": pattern}, "additionalProperties": sub}
    if exact:
        raise Unmergeable("patternProperties beside properties below a oneOf")
    if not lw.closed(node):
        if node.get("additionalProperties", True) is not True:
            raise Unmergeable("patternProperties next to properties on an open object")
        # narrower: the declared keys only (the pattern's keys and any other left out)
        node = {**node, "additionalProperties": False}
    lw.note("patternProperties (declared keys only)")  # keys matching a pattern left out
    props = dict(props)
    for pattern, sub in patterns.items():
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise Unmergeable(f"pattern {pattern!r}: {err}") from None
        for name in props:
            if not name.isascii():
                raise Unmergeable("a non-ASCII name (ECMA and Python classes differ)")
            if regex.search(name):
                props[name] = lw.merge(props[name], sub, inlined)
    return {**node, "properties": props}


def _pattern_apart(patterns: dict) -> tuple[str, Any]:
    """A (pattern, schema) of `patterns` whose whole-string names no other pattern finds."""
    for pattern, sub in patterns.items():
        if isinstance(pattern, str) and all(patterns_disjoint(pattern, other)
                                            for other in patterns if other != pattern):
            return pattern, sub
    raise Unmergeable("several patternProperties that may match one name")
