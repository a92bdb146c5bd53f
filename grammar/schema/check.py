"""Refuse JSON Schema features that xgrammar 0.2.9 would silently drop.

xgrammar's schema converter ignores some keywords (at most a log line on stderr) and so accepts
output the schema forbids. Every rule below was found by compiling a schema with and without the
keyword and matching an instance that violates only that keyword; tests/grammar/
test_grammar_schema_check.py keeps one such canary per rule, so an xgrammar upgrade that starts
honoring a keyword shows up as a failing canary rather than a silently over-strict refusal.

`pattern` is compiled by grammar/pattern.py (xgrammar's own pattern FSM over-accepts); here it
is only checked for constructs neither path supports.

Where xgrammar is *stricter* than JSON Schema we let it be (every output still validates):
patterns match the whole string, properties come in declared order, strings under
minLength/maxLength have no escapes, bounded numbers have no exponent, a type-less schema with
`properties` only produces objects.

Keywords outside the JSON Schema vocabulary (`nullable`, `x-*`, ...) are annotations to a
validator too, and so are formats the spec does not define ("url", "int32"): both pass.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable
from urllib.parse import unquote

from prescient.grammar.errors import GrammarError
from prescient.grammar.pattern import check_pattern
from prescient.grammar.schema.disjoint import Disjointness
from prescient.grammar.schema.merge import other_names

# Dropped wherever they appear (verified: a violating instance is accepted).
_DROPPED = (
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
    "minContains", "maxContains", "contains", "patternProperties", "$dynamicRef", "$recursiveRef",
)
# Maps whose empty value constrains nothing (an empty `not` or `contains` does constrain).
_EMPTY_IS_NOOP = frozenset({"dependentSchemas", "dependentRequired", "dependencies",
                            "patternProperties"})

STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
    "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
    "json-pointer", "relative-json-pointer", "regex",
})
# Standard formats xgrammar treats as any string; it enforces the other standard ones.
_UNENFORCED_FORMATS = frozenset({"iri", "iri-reference", "idn-hostname", "idn-email", "regex"})

_MAX_MULTIPLE_OF_RANGE = 9999  # widest [low, high] (high - low) xgrammar enumerates

_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems",
               "additionalItems", "contains")
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "minProperties",
                "maxProperties", "propertyNames", "unevaluatedProperties", "patternProperties")
_TYPE_SPECIFIC = _STRING_KEYS + _NUMBER_KEYS + _ARRAY_KEYS + _OBJECT_KEYS
_COMBINATORS = ("anyOf", "oneOf", "allOf")
# Every keyword that constrains an instance; anything else is an annotation.
ASSERTIONS = frozenset(
    _TYPE_SPECIFIC + _COMBINATORS + _DROPPED + ("type", "enum", "const", "$ref")
)
_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})


def check_schema(schema: Any) -> None:
    """Raise GrammarError naming the first feature xgrammar would not enforce exactly."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean", feature="schema")
    try:
        _Checker(schema).check(schema, "#", frozenset())
    except RecursionError:
        raise GrammarError("schema nesting is too deep", feature="depth") from None
    except GrammarError:
        raise
    except (TypeError, AttributeError, ValueError) as err:  # `"required": 5` and the like
        raise GrammarError(f"malformed schema: {err}", feature="schema") from None


def disjoint_as_written(root: Any, branches: list) -> bool:
    """Whether check_schema proves that no instance matches two of these `oneOf` branches
    (their references resolved in `root`); False for branches it cannot read."""
    try:
        return len(branches) < 2 or _Checker(root)._disjoint(branches, frozenset())
    except (GrammarError, TypeError, AttributeError, ValueError, KeyError, RecursionError):
        return False


class _Checker:
    def __init__(self, root: Any):
        self.root = root
        self.checked_refs: set[str] = set()
        self._disjointness: Disjointness | None = None
        self._validator = None

    def check(self, node: Any, path: str, refs_seen: frozenset[str]) -> None:
        if isinstance(node, bool):
            return  # `true`/`false` subschemas: xgrammar honors them or errors itself
        if not isinstance(node, dict):
            raise GrammarError("a subschema must be an object or a boolean", feature="schema",
                               path=path)
        for key in _DROPPED:
            if key in node and not (key in _EMPTY_IS_NOOP and node[key] in ({}, [])):
                raise GrammarError(f"'{key}' is not supported (xgrammar would ignore it)",
                                   feature=key, path=path)
        if node.get("uniqueItems") is True:
            raise GrammarError("'uniqueItems' is supported only on arrays of at most one item or "
                               "of items with a few listed values (enum, const, boolean, null, a "
                               "short integer range; xgrammar would ignore it)",
                               feature="uniqueItems", path=path)
        if "unevaluatedProperties" in node and node["unevaluatedProperties"] is not True:
            raise GrammarError("'unevaluatedProperties' is not supported (xgrammar would ignore "
                               "it); use 'additionalProperties'", feature="unevaluatedProperties",
                               path=path)
        if "$ref" in node:
            self._check_ref(node, path, refs_seen)
            return
        if any(k in node for k in _COMBINATORS):
            self._check_combinator(node, path, refs_seen)
            return
        if "enum" in node or "const" in node:
            self._check_literal(node, path)
            return
        types = _types_of(node)
        if types is None:
            types = self._inferred_types(node, path)
        if "string" in types:
            self._check_string(node, path)
        if "number" in types or "integer" in types:
            self._check_number(node, types, path)
        if "object" in types:
            self._check_object(node, path)
        self._recurse(node, path, refs_seen)

    # --- keyword families -------------------------------------------------------------------

    def _check_ref(self, node: dict, path: str, refs_seen: frozenset[str]) -> None:
        ref = node["$ref"]
        extra = _assertion_keys(node, exclude=("$ref",))
        if extra:
            raise GrammarError(f"'{extra[0]}' next to '$ref' is not supported (xgrammar would "
                               "ignore it); move it into the referenced schema",
                               feature=f"$ref+{extra[0]}", path=path)
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise GrammarError(f"'$ref' {ref!r} is not supported: only local '#/...' references "
                               "resolve (others would match anything)", feature="$ref", path=path)
        if ref in refs_seen or ref in self.checked_refs:
            return  # recursive schema: this target is being checked, or was, on another path
        self.checked_refs.add(ref)  # the verdict on a target does not depend on the path to it
        target = self._resolve(ref, path)
        self.check(target, ref, refs_seen | {ref})

    def _check_combinator(self, node: dict, path: str, refs_seen: frozenset[str]) -> None:
        present = [k for k in _COMBINATORS if k in node]
        if len(present) > 1:
            raise GrammarError(f"'{present[0]}' together with '{present[1]}' is not supported",
                               feature=present[1], path=path)
        comb = present[0]
        branches = node[comb]
        if not isinstance(branches, list) or not branches:
            raise GrammarError(f"'{comb}' must be a non-empty list", feature=comb, path=path)
        if comb == "allOf" and len(branches) > 1:
            raise GrammarError("'allOf' with more than one subschema is not supported (xgrammar "
                               "would enforce only part of it)", feature="allOf", path=path)
        for key in _assertion_keys(node, exclude=(comb,)):
            if key == "type" and self._branches_within_type(node, branches, refs_seen):
                continue
            raise GrammarError(f"'{key}' next to '{comb}' is not supported (xgrammar would ignore "
                               f"it); move it into every branch", feature=f"{comb}+{key}",
                               path=path)
        if comb == "oneOf" and len(branches) > 1 and not self._disjoint(branches, refs_seen):
            raise GrammarError("'oneOf' whose branches may overlap is not supported (xgrammar "
                               "would enforce it as 'anyOf')", feature="oneOf", path=path)
        for i, branch in enumerate(branches):
            self.check(branch, f"{path}/{comb}/{i}", refs_seen)

    def _check_literal(self, node: dict, path: str) -> None:
        key = "enum" if "enum" in node else "const"
        extra = _assertion_keys(node, exclude=("enum", "const", "type"))
        if extra:
            raise GrammarError(f"'{extra[0]}' next to '{key}' is not supported (xgrammar would "
                               "ignore it)", feature=f"{key}+{extra[0]}", path=path)
        if "enum" in node and "const" in node:
            raise GrammarError("'enum' together with 'const' is not supported", feature="const",
                               path=path)
        values = node["enum"] if key == "enum" else [node["const"]]
        if not isinstance(values, list):
            raise GrammarError("'enum' must be a list", feature="enum", path=path)
        types = _types_of(node)
        if types is not None:
            for value in values:
                if not types & _value_types(value):
                    raise GrammarError(f"{key} value {value!r} does not match 'type' "
                                       f"{sorted(types)} (xgrammar would ignore 'type')",
                                       feature=f"{key}+type", path=path)

    def _inferred_types(self, node: dict, path: str) -> frozenset[str]:
        # Without "type", xgrammar makes a schema with properties/additionalProperties an object
        # and one with items an array (stricter than JSON Schema: fine); any other type-specific
        # keyword it ignores.
        if "properties" in node or "additionalProperties" in node:
            return frozenset({"object"})
        if "items" in node:
            return frozenset({"array"})
        for key in _TYPE_SPECIFIC:
            if key in node and not (key == "format" and _format_is_annotation(node[key])):
                raise GrammarError(f"'{key}' without an explicit 'type' is not supported "
                                   "(xgrammar would ignore it)", feature=key, path=path)
        return frozenset(_JSON_TYPES)

    def _check_string(self, node: dict, path: str) -> None:
        fmt = node.get("format")
        has_length = "minLength" in node or "maxLength" in node
        if isinstance(fmt, str) and fmt in _UNENFORCED_FORMATS:
            raise GrammarError(f"format '{fmt}' is not supported (xgrammar would accept any "
                               "string)", feature=f"format:{fmt}", path=path)
        if fmt is not None and not _format_is_annotation(fmt):
            if has_length:
                raise GrammarError("'format' combined with 'minLength'/'maxLength' is not "
                                   "supported (xgrammar would ignore the length)",
                                   feature="format+minLength/maxLength", path=path)
            if "pattern" in node:
                raise GrammarError("'format' combined with 'pattern' is not supported "
                                   "(xgrammar would ignore the pattern)", feature="format+pattern",
                                   path=path)
        if "pattern" in node:
            if has_length:
                raise GrammarError("'pattern' combined with 'minLength'/'maxLength' is not "
                                   "supported (xgrammar would ignore the length)",
                                   feature="pattern+minLength/maxLength", path=path)
            check_pattern(node["pattern"], path)

    def _check_number(self, node: dict, types: frozenset[str], path: str) -> None:
        if "integer" in types:
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                        -(2 ** 63) <= value < 2 ** 63):
                    raise GrammarError(f"integer '{key}' {value!r} is outside the 64-bit range (the "
                                       "grammar engine cannot bound integers there)",
                                       feature="integer bound past 64 bits", path=path)
        if "multipleOf" not in node:
            return
        step = node["multipleOf"]
        # xgrammar enforces multipleOf only as a whole number on integers.
        if "number" in types or not isinstance(step, int) or isinstance(step, bool) or step <= 0:
            raise GrammarError("'multipleOf' is supported only as a positive whole number on "
                               "'type': 'integer' (xgrammar would ignore it)",
                               feature="multipleOf", path=path)
        # With bounds, xgrammar enumerates the range and gives up (ignoring multipleOf) on a
        # half-open range or one spanning 10000 or more integers.
        if any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            low, high = _integer_bounds(node)
            if low is None or high is None or high - low > _MAX_MULTIPLE_OF_RANGE:
                raise GrammarError("'multipleOf' with a half-open range or a range wider than "
                                   f"{_MAX_MULTIPLE_OF_RANGE} is not supported (xgrammar would "
                                   "ignore it)", feature="multipleOf+range", path=path)

    def _check_object(self, node: dict, path: str) -> None:
        props = node.get("properties") or {}
        names = node.get("propertyNames")
        # (one the lowering wrote for the keys beyond `properties`, objects.py, means just that)
        if props and names is not None and not other_names(node):
            raise GrammarError("'propertyNames' together with 'properties' is not supported "
                               "(xgrammar would not apply it to the declared names)",
                               feature="propertyNames+properties", path=path)
        for name in node.get("required") or []:
            if name not in props:
                raise GrammarError(f"required property {name!r} is not listed in 'properties' "
                                   "(xgrammar would not require it)", feature="required",
                                   path=path)

    def _recurse(self, node: dict, path: str, refs_seen: frozenset[str]) -> None:
        for name, sub in (node.get("properties") or {}).items():
            self.check(sub, f"{path}/properties/{name}", refs_seen)
        for key in ("additionalProperties", "items", "unevaluatedItems"):
            sub = node.get(key)
            if isinstance(sub, dict):
                self.check(sub, f"{path}/{key}", refs_seen)
        names = node.get("propertyNames")
        if isinstance(names, dict):
            # property names are strings: xgrammar applies string keywords here without a type
            self.check({"type": "string", **names}, f"{path}/propertyNames", refs_seen)
        for i, sub in enumerate(node.get("prefixItems") or []):
            self.check(sub, f"{path}/prefixItems/{i}", refs_seen)

    # --- helpers ----------------------------------------------------------------------------

    def _resolve(self, ref: str, path: str) -> Any:
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise GrammarError(f"'$ref' {ref!r} does not resolve", feature="$ref", path=path)
        return target

    def _deref(self, node: Any, refs_seen: frozenset[str]) -> Any:
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            if ref in refs_seen or not (ref == "#" or ref.startswith("#/")):
                return None
            refs_seen = refs_seen | {ref}
            node = self._resolve(ref, ref)
        return node

    def _branch_types(self, branch: Any, refs_seen: frozenset[str]) -> frozenset[str] | None:
        """The JSON types a branch can produce, or None when not evident from the branch."""
        branch = self._deref(branch, refs_seen)
        if not isinstance(branch, dict):
            return None
        if "const" in branch:
            return _value_types(branch["const"])
        if isinstance(branch.get("enum"), list):
            out: frozenset[str] = frozenset()
            for value in branch["enum"]:
                out |= _value_types(value)
            return out
        return _types_of(branch)

    def _branches_within_type(self, node: dict, branches: list, refs_seen: frozenset[str]) -> bool:
        allowed = _types_of(node)
        if allowed is None:
            return False
        if "number" in allowed:
            allowed = allowed | {"integer"}
        for branch in branches:
            types = self._branch_types(branch, refs_seen)
            if types is None or not types <= allowed:
                return False
        return True

    def _disjoint(self, branches: list, refs_seen: frozenset[str]) -> bool:
        """A sound (not complete) proof that no instance matches two oneOf branches; then
        xgrammar's anyOf fallback is exact."""
        resolved = [self._deref(b, refs_seen) for b in branches]
        if all(isinstance(b, dict) for b in resolved):
            literal_sets = [_literal_values(b) for b in resolved]
            if all(s is not None for s in literal_sets) and _pairwise_disjoint(literal_sets):
                return True
            type_sets = [self._branch_types(b, refs_seen) for b in resolved]
            if all(t is not None for t in type_sets) and _pairwise_disjoint(
                [_widen(t) for t in type_sets]
            ):
                return True
            if all(_types_of(b) == frozenset({"object"}) for b in resolved) and self._discriminated(
                    resolved, refs_seen):
                return True
        return self._prover().pairwise(branches)

    def _prover(self) -> Disjointness:
        """disjoint.py's pairwise proof, for the branches the quick rules above do not settle."""
        if self._disjointness is None:
            self._disjointness = Disjointness(self.root, lambda ref: self._resolve(ref, ref), self._valid)
        return self._disjointness

    def _valid(self, instance: Any, schema: Any) -> bool:
        if self._validator is None:
            import jsonschema

            # the draft the schema names, else the newest (what the compliance check uses too)
            self._validator = jsonschema.validators.validator_for(self.root)(self.root)
        return self._validator.evolve(schema=schema).is_valid(instance)

    def _discriminated(self, branches: list[dict], refs_seen: frozenset[str]) -> bool:
        common = set.intersection(*(set(b.get("required") or []) for b in branches))
        for name in common:
            value_sets = []
            for branch in branches:
                prop = self._deref((branch.get("properties") or {}).get(name), refs_seen)
                value_sets.append(_literal_values(prop) if isinstance(prop, dict) else None)
            if all(s is not None for s in value_sets) and _pairwise_disjoint(value_sets):
                return True
        return False


def _integer_bounds(node: dict) -> tuple[float | None, float | None]:
    """Inclusive integer bounds (None where unbounded)."""
    low = high = None
    if isinstance(node.get("minimum"), (int, float)):
        low = math.ceil(node["minimum"])
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(
            node["exclusiveMinimum"], bool):
        bound = math.floor(node["exclusiveMinimum"]) + 1
        low = bound if low is None else max(low, bound)
    if isinstance(node.get("maximum"), (int, float)):
        high = math.floor(node["maximum"])
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(
            node["exclusiveMaximum"], bool):
        bound = math.ceil(node["exclusiveMaximum"]) - 1
        high = bound if high is None else min(high, bound)
    return low, high


def _assertion_keys(node: dict, exclude: Iterable[str]) -> list[str]:
    skip = set(exclude)
    return [k for k in node if k in ASSERTIONS and k not in skip]


def _types_of(node: dict) -> frozenset[str] | None:
    t = node.get("type")
    if t is None:
        return None
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not names or not all(
        isinstance(x, str) and x in _JSON_TYPES for x in names
    ):
        raise GrammarError(f"invalid 'type' {t!r}", feature="type")
    return frozenset(names)


def _value_types(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    if isinstance(value, list):
        return frozenset({"array"})
    return frozenset({"object"})


def _widen(types: frozenset[str]) -> frozenset[str]:
    # every integer is a number, so the two types overlap
    return types | {"integer", "number"} if types & {"integer", "number"} else types


def _literal_values(node: dict) -> frozenset[str] | None:
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        return None
    return frozenset(json.dumps(_normalize_numbers(v), sort_keys=True) for v in values)


def _normalize_numbers(value: Any) -> Any:
    # JSON Schema equality: 1 == 1.0, key order irrelevant (sort_keys above)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normalize_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalize_numbers(v) for k, v in value.items()}
    return value


def _pairwise_disjoint(sets: list) -> bool:
    seen: set = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True


def _format_is_annotation(fmt: Any) -> bool:
    """Formats JSON Schema does not define are annotations (a validator ignores them too)."""
    return not isinstance(fmt, str) or fmt not in STANDARD_FORMATS

