"""A sound proof that two schemas share no instance the engine can produce (used by check.py to
turn a `oneOf` into xgrammar's `anyOf` fallback only where that is exact).

`Disjointness(root, resolve, validator).disjoint(a, b)` is True only when no output of a grammar
for `a` validates against `b` and no output for `b` validates against `a`. "Output" matters in
one place: this engine's patterns match the whole string, so a string from `a` is a whole-string
match of a's pattern (regex_overlap.py), while `b` is read as JSON Schema reads it (a search).
Everything else is reasoned about as JSON Schema means it, with each side widened where exact
reasoning would be hard (a `$ref` is its target, keywords beside it ignored; an `allOf` part, a
branch of a combinator, a property's declared schema stand for more than the node allows), so a
True never depends on a detail the proof skipped. `format` is ignored: `jsonschema` (what the
compliance check uses) treats it as an annotation, so two branches told apart only by formats do
overlap for it. The rules:

- the JSON types the two can have do not meet;
- every literal (`enum`/`const`) one side allows fails the other (checked with `jsonschema`);
- for each type both can have, the type's keywords exclude each other: string lengths, patterns,
  numeric ranges; an object key one requires that the other forbids or whose two schemas are
  disjoint, `not: {required}`, property counts; array lengths, or a first item both must have
  whose schemas are disjoint;
- a combinator side: every `anyOf`/`oneOf` branch disjoint from the other side, or one `allOf`
  part; a `not: X` side against a side provably within X.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from prescient.grammar.schema.regex_overlap import disjoint as patterns_disjoint
from prescient.grammar.schema.regex_overlap import pattern_lengths

_TYPES = ("string", "number", "boolean", "null", "array", "object")  # integer is a number
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "example", "$comment",
                          "deprecated", "readOnly", "writeOnly", "$id", "id", "$schema",
                          "definitions", "$defs", "format"})
_MAX_DEPTH = 12


class Disjointness:
    def __init__(self, root: Any, resolve: Callable[[str], Any], valid: Callable[[Any, Any], bool]):
        """`resolve(ref)` gives a local reference's target (raises when it does not resolve);
        `valid(instance, schema)` says whether `jsonschema` accepts it (refs against root)."""
        self.root = root
        self.resolve = resolve
        self.valid = valid
        self._memo: dict = {}

    # --- entry ------------------------------------------------------------------------------

    def pairwise(self, branches: list) -> bool:
        return all(self.disjoint(branches[i], branches[j])
                   for i in range(len(branches)) for j in range(i + 1, len(branches)))

    def disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        key = (id(a), id(b))
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a cycle through references proves nothing
        out = self._disjoint(a, b, depth)
        self._memo[key] = out
        return out

    # --- the rules --------------------------------------------------------------------------

    def _disjoint(self, a: Any, b: Any, depth: int) -> bool:
        if depth > _MAX_DEPTH:
            return False
        a, b = self._deref(a), self._deref(b)
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = self.types(a), self.types(b)
        common = ta & tb
        if not common:
            return True
        for x, y in ((a, b), (b, a)):
            values = _literals(x)
            if values is not None and all(not self._valid(v, y) for v in values):
                return True
        for x, y in ((a, b), (b, a)):
            if self._combinator_side(x, y, depth):
                return True
        return all(self._typed(t, a, b, depth) for t in common)

    def _combinator_side(self, x: dict, y: dict, depth: int) -> bool:
        for comb in ("anyOf", "oneOf"):
            if isinstance(x.get(comb), list) and x[comb] and all(
                    self.disjoint(br, y, depth + 1) for br in x[comb]):
                return True
        if isinstance(x.get("allOf"), list) and any(self.disjoint(p, y, depth + 1) for p in x["allOf"]):
            return True
        if isinstance(x.get("not"), (dict, bool)) and self.within(y, x["not"], depth + 1):
            return True
        return False

    def _typed(self, t: str, a: dict, b: dict, depth: int) -> bool:
        if t == "string":
            return self._strings(a, b) and self._strings(b, a)
        if t == "number":
            return _ranges_disjoint(_number_range(a), _number_range(b))
        if t == "object":
            return self._objects(a, b, depth) or self._objects(b, a, depth)
        if t == "array":
            return self._arrays(a, b, depth)
        return False  # booleans and nulls: only literals tell them apart

    def _strings(self, a: dict, b: dict) -> bool:
        """No string `a` produces satisfies `b`."""
        la, lb = _length_range(a), _length_range(b)
        if la is None or lb is None:
            return False
        if la[1] is not None and lb[0] > la[1] or lb[1] is not None and la[0] > lb[1]:
            return True
        if la[1] == 0:  # a produces "" only
            return not self._valid("", b)
        pa, pb = a.get("pattern"), b.get("pattern")
        whole = pattern_lengths(pa) if isinstance(pa, str) else None  # a's strings match pa whole
        if whole is not None and (whole[1] is not None and lb[0] > whole[1] or
                                  lb[1] is not None and whole[0] > lb[1]):
            return True
        return isinstance(pa, str) and isinstance(pb, str) and patterns_disjoint(pa, pb)

    def _objects(self, a: dict, b: dict, depth: int) -> bool:
        """An object satisfying `a` cannot satisfy `b` (by a's required keys against b)."""
        required = a.get("required") if isinstance(a.get("required"), list) else []
        banned = _not_required(b)
        if banned is not None and set(banned) <= set(required):
            return True
        max_b = b.get("maxProperties")
        if isinstance(max_b, int) and len(set(required)) > max_b:
            return True
        min_a = a.get("minProperties")
        if isinstance(min_a, int) and _closed(b) and min_a > len(b.get("properties") or {}):
            return True
        for name in required:
            if not isinstance(name, str):
                continue
            sb = _key_schema(b, name)
            if sb is False:
                return True
            sa = _key_schema(a, name)
            if sa is not None and sb is not None and self.disjoint(sa, sb, depth + 1):
                return True
        return False

    def _arrays(self, a: dict, b: dict, depth: int) -> bool:
        ra, rb = _count_range(a, "minItems", "maxItems"), _count_range(b, "minItems", "maxItems")
        if _ranges_disjoint((ra[0], False, ra[1], False), (rb[0], False, rb[1], False)):
            return True
        must = max(ra[0], rb[0])  # items an array of both has at least
        for i in range(min(must, 8)):
            ia, ib = _item_schema(a, i), _item_schema(b, i)
            if ia is not None and ib is not None and self.disjoint(ia, ib, depth + 1):
                return True
        return False

    # --- within: every instance of `a` satisfies `x` (sound, incomplete) --------------------

    def within(self, a: Any, x: Any, depth: int = 0) -> bool:
        if depth > _MAX_DEPTH:
            return False
        a, x = self._deref(a), self._deref(x)
        if x is True or x == {} or a is False:
            return True
        if not isinstance(a, dict) or not isinstance(x, dict):
            return False
        if _same(a, x):
            return True
        values = _literals(a)
        if values is not None:
            return all(self._valid(v, x) for v in values)
        for comb in ("anyOf", "oneOf"):  # oneOf: an instance matches one branch at least
            if isinstance(a.get(comb), list) and a[comb] and all(
                    self.within(br, x, depth + 1) for br in a[comb]):
                return True
        if isinstance(a.get("allOf"), list) and any(self.within(p, x, depth + 1) for p in a["allOf"]):
            return True
        keys = set(x) - _ANNOTATIONS
        if not keys <= {"type", "properties", "required"}:
            return False
        if "type" in x and not _raw_types(a) <= _widened(_raw_types(x)):
            return False
        objects = "object" in self.types(a)
        if objects and "required" in x:
            mine = a.get("required") if isinstance(a.get("required"), list) else []
            if not isinstance(x["required"], list) or not set(x["required"]) <= set(mine):
                return False
        if objects and isinstance(x.get("properties"), dict):
            for name, sub in x["properties"].items():
                own = _key_schema(a, name)
                if own is False:
                    continue  # a never has the key
                if own is None or not self.within(own, sub, depth + 1):
                    return False
        return True

    # --- helpers ----------------------------------------------------------------------------

    def types(self, node: Any, depth: int = 0) -> frozenset[str]:
        """The JSON types (integer counted as number) an instance of `node` may have."""
        node = self._deref(node)
        if node is False:
            return frozenset()
        if not isinstance(node, dict) or depth > _MAX_DEPTH:
            return frozenset(_TYPES)
        out = frozenset(_TYPES)
        declared = node.get("type")
        if declared is not None:
            names = [declared] if isinstance(declared, str) else declared
            if isinstance(names, list) and all(isinstance(n, str) for n in names):
                out = frozenset("number" if n == "integer" else n for n in names) & out
        values = _literals(node)
        if values is not None:
            out &= frozenset(t for v in values for t in _value_types(v))
        for comb in ("anyOf", "oneOf"):
            if isinstance(node.get(comb), list) and node[comb]:
                out &= frozenset().union(*(self.types(br, depth + 1) for br in node[comb]))
        if isinstance(node.get("allOf"), list):
            for part in node["allOf"]:
                out &= self.types(part, depth + 1)
        return out

    def _deref(self, node: Any) -> Any:
        for _ in range(16):
            if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
                return node
            node = self.resolve(node["$ref"])  # keywords beside it only narrow: ignored
        return True  # a chain of references too long to follow: anything

    def _valid(self, value: Any, schema: Any) -> bool:
        try:
            return self.valid(value, schema)
        except Exception:  # noqa: BLE001 - a schema jsonschema cannot read: assume it may match
            return True


def _literals(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return node["enum"]
    return None


_RAW = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})


def _raw_types(node: dict) -> frozenset[str]:
    """The types `node` may have, integer apart from number (a superset)."""
    out = _RAW
    declared = node.get("type")
    names = [declared] if isinstance(declared, str) else declared
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        out = frozenset(names) & _RAW
        if "number" in out:
            out |= {"integer"}
    values = _literals(node)
    if values is not None:
        out &= frozenset("integer" if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and float(v).is_integer() else t for v in values for t in _value_types(v))
    return out


def _widened(types: frozenset[str]) -> frozenset[str]:
    return types | {"integer"} if "number" in types else types


def _value_types(value: Any) -> tuple[str, ...]:
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("boolean",)
    if isinstance(value, (int, float)):
        return ("number",)
    if isinstance(value, str):
        return ("string",)
    return ("array",) if isinstance(value, list) else ("object",)


def _same(a: Any, b: Any) -> bool:
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (TypeError, ValueError):
        return False


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number_range(node: dict) -> tuple:
    """(low, low exclusive, high, high exclusive); None bounds are open."""
    low = high = None
    low_x = high_x = False
    if _num(node.get("minimum")):
        low = node["minimum"]
        low_x = node.get("exclusiveMinimum") is True  # draft 4
    if _num(node.get("exclusiveMinimum")) and (low is None or node["exclusiveMinimum"] >= low):
        low, low_x = node["exclusiveMinimum"], True
    if _num(node.get("maximum")):
        high = node["maximum"]
        high_x = node.get("exclusiveMaximum") is True
    if _num(node.get("exclusiveMaximum")) and (high is None or node["exclusiveMaximum"] <= high):
        high, high_x = node["exclusiveMaximum"], True
    return low, low_x, high, high_x


def _ranges_disjoint(a: tuple, b: tuple) -> bool:
    for (_, _, high, high_x), (low, low_x, _, _) in ((a, b), (b, a)):
        if high is not None and low is not None and (high < low or (high == low and (high_x or low_x))):
            return True
    return False


def _count_range(node: dict, low_key: str, high_key: str) -> tuple[int, int | None]:
    low = node.get(low_key)
    high = node.get(high_key)
    return (low if _num(low) else 0), (high if _num(high) else None)


def _length_range(node: dict) -> tuple[int, int | None] | None:
    return _count_range(node, "minLength", "maxLength")


def _closed(node: dict) -> bool:
    return node.get("additionalProperties") is False and not node.get("patternProperties")


def _key_schema(node: dict, name: str) -> Any:
    """A schema every value of key `name` in an instance of `node` satisfies (wider is fine);
    False when the node forbids the key; None when unknown."""
    props = node.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and patterns:
        if not name.isascii():
            return None
        try:
            hits = [s for p, s in patterns.items() if re.search(p, name)]
        except re.error:
            return None
        if hits:
            return hits[0]
    ap = node.get("additionalProperties", True)
    if ap is False:
        return False
    return ap if isinstance(ap, (dict, bool)) else None


def _item_schema(node: dict, i: int) -> Any:
    prefix = node.get("prefixItems")
    if not isinstance(prefix, list):
        prefix = node.get("items") if isinstance(node.get("items"), list) else None
        tail = node.get("additionalItems", True)
    else:
        tail = node.get("items", True)
    if prefix is not None:
        return prefix[i] if i < len(prefix) else tail
    items = node.get("items", True)
    return items if isinstance(items, (dict, bool)) else None


def _not_required(node: dict) -> list | None:
    sub = node.get("not")
    if isinstance(sub, dict) and set(sub) == {"required"} and isinstance(sub["required"], list):
        return sub["required"]
    return None
