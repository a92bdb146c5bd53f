"""Object rewrites for lower.py: undeclared required names, false properties,
`not: {required}`, dependencies (`dependencies`, `dependentRequired`, `dependentSchemas`: a
case split on the trigger's presence where the names an object may have are known) and
patternProperties (declared names, patterns of a few names declared, one class of other keys).

`lw` is the lower._Lowerer doing the walk (its merge, closed). `exact` is set below a
`oneOf`: a narrowing there could make two overlapping branches look disjoint, so only exact
rewrites run. A rule returns False only when no instance can match, whatever the types (a
`required` with no `type` lets non-objects through).
"""

from __future__ import annotations

import json
import re
from typing import Any

from prescient.grammar.regex.errors import RegexUnsupported
from prescient.grammar.regex.finite import finite_strings, without_strings
from prescient.grammar.schema.closed_objects import closes

from prescient.grammar.schema.merge import Unmergeable, not_an_object
from prescient.grammar.schema.not_rules import required_sets
from prescient.grammar.schema.merge import ANNOTATIONS
from prescient.grammar.schema.regex_overlap import disjoint as patterns_disjoint
from prescient.grammar.schema.regex_overlap import within
from prescient.grammar.schema.nodes import (
    OTHER_NAMES,
    combinator,
    other_names,
    typed_object,
    without,
)

_FEW_NAMES = 32  # a pattern of at most this many names declares them
_MAX_DEPENDENCY_CASES = 16  # anyOf branches a case split on dependencies may make


def object_rules(lw, node: dict, inlined: frozenset[str], exact: bool) -> Any:
    """One rewrite of an object node, or the node itself (same object) when none applies."""
    # dependencies first: they may declare names, and a name a false schema or `not` forbids
    # must be seen as such by the rules below, not redeclared after them
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if node.get(key):
            if exact and node.get("additionalProperties") is not False:
                # (the split closes the object explicitly: exact only where its author did)
                raise Unmergeable("dependencies on an object not closed by its author, below a oneOf")
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
    marked = other_names(node)  # its other keys leave every declared name out (_keys_by_pattern)
    if falses and (marked or lw.closed({**out, "properties": props})):
        if any(n in required for n in falses):
            if typed_object(node):
                return False  # a required key whose schema is false
            return not_an_object(node)  # no object has it: what else the node allows (exact)
        props = {k: v for k, v in props.items() if v is not False}
        if not marked:
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
    # the names an instance may have are known: declared ones, and with patternProperties and
    # no other key allowed, the patterns' (a name is forbidden by a false schema, never by
    # leaving it out, which a pattern could let back in)
    patterned = bool(node.get("patternProperties")) and node.get("additionalProperties") is False
    if not isinstance(deps, dict) or not (lw.closed(node) or patterned):
        raise Unmergeable("dependencies on an open object")
    (name, dep), *others = deps.items()
    props = dict(node.get("properties") or {})
    # declare every name a dependency needs, with the schema it had as an undeclared key, before
    # this rewrite closes the object explicitly (a name declared false stays false)
    for d in (d for v in deps.values() if isinstance(v, list) for d in v):
        if d not in props and undeclared_schema(node, d) is not None:
            props[d] = undeclared_schema(node, d)
    if patterned and name not in props and undeclared_schema(node, name) is not None:
        props[name] = undeclared_schema(node, name)  # a pattern's name may trigger it too
    node = {**without(node, key), **({key: dict(others)} if others else {}),
            "properties": props, "additionalProperties": False}
    required = list(node.get("required") or [])
    if props.get(name, False) is False:
        return node  # the closed object never has it: the dependency never applies
    absent = {**node, "properties": {**props, name: False} if patterned else without(props, name)}
    if isinstance(dep, list) and any(props.get(d, False) is False for d in dep):
        if name in required:
            raise Unmergeable(f"{name!r} needs a key the object cannot have")
        return absent  # present is impossible: absent
    if name in required:
        return _with_dependency(lw, node, dep, inlined)
    if _cases(props, set(required), list(deps.items()), _MAX_DEPENDENCY_CASES) > _MAX_DEPENDENCY_CASES:
        raise Unmergeable("too many optional dependencies")
    present = _with_dependency(lw, {**node, "required": list(dict.fromkeys([*required, name]))},
                               dep, inlined)
    return combinator("anyOf", [present, absent])


def _cases(props: dict, required: set, deps: list, limit: int) -> int:
    """How many anyOf branches the case split on presence makes (an upper bound: a schema
    dependency counts only its own `required`), or a number past `limit`. A present trigger
    brings its names in, and a trigger that needs a name the object cannot have is absent, so
    chained dependencies (four names all or none) make few cases, not 2**4."""
    if not deps:
        return 1
    (name, dep), rest = deps[0], deps[1:]
    if props.get(name, False) is False:
        return _cases(props, required, rest, limit)
    needs = dep if isinstance(dep, list) else dep.get("required", []) if isinstance(dep, dict) else []
    needs = needs if isinstance(needs, list) else []
    gone = without(props, name)
    if any(props.get(d, False) is False for d in needs):
        return 0 if name in required else _cases(gone, required, rest, limit)
    present = _cases(props, required | {name, *needs}, rest, limit)
    if name in required or present > limit:
        return present
    return present + _cases(gone, required, rest, limit)


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
    if len(patterns) == 1 and not node.get("properties"):
        (pattern, sub), = patterns.items()
        if isinstance(pattern, str) and within(r"^[\s\S]*$", pattern):
            return {**without(node, "patternProperties"), "additionalProperties": sub}  # every name matches: exact
    if "propertyNames" not in node:
        try:
            return _keys_by_pattern(lw, node, patterns, inlined, exact)
        except RegexUnsupported:
            pass  # the narrower forms below, or check_schema's refusal
        except Unmergeable:
            if exact:
                raise
    node = without(node, "patternProperties")
    props = node.get("properties") or {}
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
    return {**node, "properties": _merge_matching(lw, props, patterns, inlined)}


def _keys_by_pattern(lw, node: dict, patterns: dict, inlined: frozenset[str], exact: bool) -> Any:
    """patternProperties written as declared names and one class of other keys (exact where the
    object allowed no other key, by its author or by closing):

    - a pattern of a few names (`^(MD5|MD6)$`) declares them: each is a property whose schema
      is every pattern's that finds it (and its declared one);
    - the other patterns must share one schema S: their keys become `additionalProperties: S`
      with `propertyNames` the union of the patterns but the declared names (regex/finite.py),
      which xgrammar applies to the keys beyond `properties` only (merge.OTHER_NAMES says so to
      check_schema). The keys are those a pattern finds (JSON Schema's reading, not the
      whole-string one of a string's `pattern`), so every pattern of S finds a generated key,
      and no pattern of a few names does: those names are declared, and a name followed by a
      newline (which Python's `$` also accepts) is left out too.

    Unmergeable (or RegexUnsupported) when the patterns need more than one class of keys."""
    original = node
    node = without(node, "patternProperties")
    props = dict(node.get("properties") or {})
    required = list(node.get("required") or [])
    few: list[str] = []
    many: dict = {}
    for pattern, sub in patterns.items():
        if not isinstance(pattern, str):
            raise Unmergeable("a pattern that is not a string")
        names = finite_strings(pattern, _FEW_NAMES)
        if names is None:
            many[pattern] = sub
        else:
            few += names
    for name in few:
        props.setdefault(name, {})  # every pattern that finds it merges its schema in below
    schemas = {json.dumps(sub, sort_keys=True) for sub in many.values()}
    if len(schemas) > 1:
        raise Unmergeable("several patternProperties with different schemas")
    props = _merge_matching(lw, props, patterns, inlined)
    falses = [n for n, v in props.items() if v is False]
    if any(n in required for n in falses):
        if typed_object(node):
            return False  # a required key whose schema is false
        return not_an_object(node)  # no object has it: what else the node allows (exact)
    ap = node.get("additionalProperties")
    every = not few and any(within(r"^[\s\S]*$", p) for p in many)  # every name is a pattern's
    # exact when no key beyond the patterns' and the declared ones was allowed
    exact_here = every or ap is False or (
        ap is None and lw.closing and closes(without(original, "patternProperties")))
    if not exact_here:
        if exact:
            raise Unmergeable("patternProperties on an open object below a oneOf")
        lw.note("patternProperties (only matching names)")
    out = {**node, "properties": {n: v for n, v in props.items() if v is not False}}
    if not out["properties"]:
        del out["properties"]
    if not many:
        return {**out, "additionalProperties": False}
    if every:  # any other key: xgrammar leaves the declared names out of them itself
        return {**out, "additionalProperties": next(iter(many.values()))}
    declared = list(props) + [name + "\n" for name in few]
    keys = without_strings(list(many), [n for n in declared if _may_match(many, n)], search=True)
    if keys is None:
        return {**out, "additionalProperties": False}
    (sub, *_) = many.values()
    return {**out, "additionalProperties": sub,
            "propertyNames": {"type": "string", "pattern": keys, OTHER_NAMES: True}}


def _may_match(patterns: dict, name: str) -> bool:
    """Whether one of `patterns` may find `name` (Python's reading holds the engine's, so a name
    no pattern finds there need not be left out)."""
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except re.error:
            return True
    return False


def _merge_matching(lw, props: dict, patterns: dict, inlined: frozenset[str]) -> dict:
    """Each declared property merged with the schema of every pattern that finds its name."""
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
    return props


def _pattern_apart(patterns: dict) -> tuple[str, Any]:
    """A (pattern, schema) of `patterns` whose whole-string names no other pattern finds."""
    for pattern, sub in patterns.items():
        if isinstance(pattern, str) and all(patterns_disjoint(pattern, other)
                                            for other in patterns if other != pattern):
            return pattern, sub
    raise Unmergeable("several patternProperties that may match one name")
