"""Rewrite a JSON schema into an equivalent (or narrower) one that xgrammar enforces exactly.

check.py refuses shapes xgrammar would silently weaken; many real-world schemas use them
only as a way of writing, and a single schema says the same. Each rewrite is exact, or narrower
where noted (every output still validates against the original schema, which is what the
compliance benchmark checks with `jsonschema`). A node no rule can rewrite is left as it is, for
check_schema to refuse with its usual message.

- keywords next to `$ref` (2019+ drafts; drafts 4-7 ignore them, and so does the rewrite),
  `allOf` (of any number of parts: patterns intersected, `not`s joined, two `if`s as cases),
  `anyOf`, `oneOf`: merged into the target / every branch (merge.py);
- `enum`/`const` next to other keywords: the values that satisfy those keywords;
- object rules (objects.py): undeclared required names declared, false properties
  removed from closed objects, `not: {required}`, `dependencies`/`dependentRequired`/
  `dependentSchemas` (a case split on presence), `patternProperties` (declared names, names
  of a few-name pattern, and one class of other keys);
- `uniqueItems` on arrays of at most one item or of a few listed values (unique_items.py);
- scalar rules (scalars.py): `not: {type}`, a whole-number `multipleOf` on numbers, integer
  bounds made whole and clamped into 64 bits, a `pattern` intersected with minLength/maxLength
  (regex_length.py), anchors inside groups dropped, `format` next to lengths (email, uri),
  string or number keywords without a `type` (made strings / numbers: narrower);
- draft-4 tuple `items` as `prefixItems`;
- `oneOf` whose branches are provably disjoint as written (check.py with disjoint.py): `anyOf`
  (exact; below it narrowing is sound); values two branches share (null, [], "", {}) taken out
  of them (one_of_singletons.py, exact); `oneOf` of closed objects whose branches may overlap:
  disjoint narrower branches, then `anyOf` (one_of.py);
- a fractional `multipleOf` (fractional_step.py), `format` beside lengths or a pattern and
  formats xgrammar does not enforce (formats.py), `if`/`then`/`else` on properties
  (conditionals.py), `not` of literals (beside a pattern, on any types), one character or
  required names (not_rules.py, objects.py), a type list with object keywords split by type.

The root's definitions stay at the root whatever its rewrites make of it, so that references
into them resolve.

Below a remaining `oneOf` (and in the definitions such oneOfs reach) only exact rewrites run:
xgrammar treats `oneOf` as `anyOf`, which is exact only for disjoint branches, and check_schema's
proof of that must see the branches as written, not narrowed. A schema proved to accept nothing
is refused as "unsatisfiable". "Closed" means additionalProperties is false, or will be set false
by closed_objects.py. References are first made simple (`#` or `#/definitions/<name>`) by
refs.py; a schema with embedded resources (a subschema `$id` with its own base) is left as it is.
Every narrowing rule that runs is named in `lower_schema(..., narrowed=[...])`, so reports count
narrowed schemas apart from exact ones.
"""

from __future__ import annotations

import re
from typing import Any

from prescient.grammar.errors import GrammarError
from prescient.grammar.schema.check import disjoint_as_written
from prescient.grammar.schema.closed_objects import closes
from prescient.grammar.schema.merge import Unmergeable, merge
from prescient.grammar.schema.nodes import (
    COMBINATORS,
    NON_ASSERTIONS,
    OTHER_NAMES,
    VALUE_KEYS,
    assertions,
    combinator,
    forbids_undeclared,
    is_object,
    other_names,
    typed_object,
    without,
)
from prescient.grammar.schema import formats
from prescient.grammar.schema.check import STANDARD_FORMATS
from prescient.grammar.schema.formats import format_with_pattern
from prescient.grammar.schema.conditionals import if_then_else
from prescient.grammar.schema.fractional_step import fractional_step, fractional_steps
from prescient.grammar.schema.not_rules import not_literals, not_values_by_type
from prescient.grammar.schema.objects import object_rules
from prescient.grammar.schema.one_of import disjoint_one_of
from prescient.grammar.schema.one_of_singletons import shared_singletons
from prescient.grammar.schema.refs import localize_refs
from prescient.grammar.schema.unique_items import unique_items
from prescient.grammar.schema.scalars import (
    format_with_length,
    integer_bounds,
    integer_bounds_to_fix,
    integer_steps,
    not_type,
    number_keywords_without_type,
    object_keywords_without_type,
    pattern_anchors,
    pattern_with_length,
    string_keywords_without_type,
    whole_step,
)

_SUBSCHEMA_MAPS = ("properties", "definitions", "$defs", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# Not `not` or `if`: narrowing there would widen the schema. Left alone, check_schema refuses them.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems",
              "unevaluatedItems")
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                   "minProperties", "maxProperties", "dependencies", "dependentRequired",
                   "dependentSchemas")
_SIMPLE_REF = re.compile(r"^#(/(definitions|\$defs)/[^/]+)?$")
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")  # keywords beside $ref ignored
# A malformed schema (`"required": 5`) makes a rule fail in Python: leave it to check_schema.
_CANNOT = (Unmergeable, TypeError, ValueError, AttributeError, KeyError, IndexError)


def lower_schema(schema: Any, closing: bool = True, narrowed: list[str] | None = None) -> Any:
    """A rewritten copy of `schema` (the input is not changed); `closing` says whether
    closed_objects.py will close declared objects afterwards. Raises GrammarError when a
    rewrite proves the schema unsatisfiable, or when a reference does not resolve (refs.py).
    `narrowed`, when given, gets the name of every narrowing rule that ran (none: the result
    is equivalent to `schema`, up to the engine-wide policies: closed declared objects,
    whole-string patterns, one JSON layout)."""
    if not isinstance(schema, dict):
        return schema
    schema = localize_refs(_without_marks(schema))
    if not _refs_are_simple(schema):
        return schema
    notes: list[str] = []
    try:
        out = _lower_all(schema, closing, notes, None)
        # Pass 1 kept exact every definition a oneOf not provably disjoint as written reaches.
        # Those that only oneOfs the lowering then made disjoint reach need not be: pass 2 keeps
        # exact only what the oneOfs left in pass 1's result reach, and is used when the oneOfs
        # left in its own result reach no more than that.
        if isinstance(out, dict):
            below = _definitions_below_one_ofs(out, only_open=False)
            if not below >= _definitions_below_one_ofs(schema, only_open=True):
                notes2: list[str] = []
                out2 = _lower_all(schema, closing, notes2, below)
                if isinstance(out2, dict) and _definitions_below_one_ofs(out2, only_open=False) <= below:
                    out, notes = out2, notes2
        # A oneOf left unproved that is reached from its own branches (a recursive definition)
        # keeps its definition exact above, so one_of.py never narrows it. Pass 3 starts from
        # no exact definitions and adds those the oneOfs left in its result reach, until they
        # are already exact (then no narrowed definition sits below a remaining oneOf).
        if isinstance(out, dict) and _has_open_one_of(out):
            exact: set = set()
            for _ in range(3):
                notes3: list[str] = []
                out3 = _lower_all(schema, closing, notes3, exact)
                if not isinstance(out3, dict):
                    break
                reached = _definitions_below_one_ofs(out3, only_open=False)
                if reached <= exact:
                    if not _has_open_one_of(out3):
                        out, notes = out3, notes3
                    break
                exact |= reached
    except RecursionError:
        return schema  # check_schema refuses it for its depth
    if out is False:
        # Narrowing rewrites may have left nothing; only the exact rules prove unsatisfiable.
        if _Lowerer(schema, closing).run(exact=True) is not False:
            raise GrammarError("the narrower schema this one needs (overlapping oneOf branches, "
                               "dependencies, ...) leaves nothing to generate", feature="narrowing")
        raise GrammarError("the schema is unsatisfiable: no instance satisfies it",
                           feature="unsatisfiable")
    # (closing an open object is a narrowing: not where a oneOf is left for check_schema to prove)
    out = _without_false_properties(out, closing, notes if not (
        isinstance(out, dict) and _has_open_one_of(out)) else None)
    if narrowed is not None:
        narrowed.extend(dict.fromkeys(notes))
    return out


def _undeclared_required(node: dict) -> bool:
    """A required name `properties` does not declare (the object rules declare it, on objects)."""
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return any(isinstance(n, str) and n not in props for n in required)


def _without_marks(node: Any) -> Any:
    """`node` without the lowering's own marks (merge.OTHER_NAMES): only a propertyNames this
    lowering wrote may carry one, never a client's schema."""
    if isinstance(node, list):
        return [_without_marks(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in VALUE_KEYS:
            out[key] = value
        elif key in ("properties", "definitions", "$defs", "patternProperties") and isinstance(value, dict):
            out[key] = {n: _without_marks(v) for n, v in value.items()}  # names, not keywords
        elif key != OTHER_NAMES:
            out[key] = _without_marks(value)
    return out


def _lower_all(schema: dict, closing: bool, notes: list[str], exact_definitions: set | None) -> Any:
    out = _Lowerer(schema, closing, notes, exact_definitions).run()
    for _ in range(3):  # a definition lowered to false: its references are false too
        defs = [out.get(kind) if isinstance(out, dict) else None for kind in ("definitions", "$defs")]
        # a client's `$defs` may be any JSON value; one that is not an object defines nothing
        dead = {f"#/{kind}/{name}" for kind, d in zip(("definitions", "$defs"), defs) if isinstance(d, dict)
                for name, sub in d.items() if sub is False}
        if not dead or not isinstance(out, dict):
            break
        out = _without_refs_to(out, dead)
        if isinstance(out, dict):
            out = _Lowerer(out, closing, notes, exact_definitions).run()
    return out


class _Lowerer:
    def __init__(self, root: dict, closing: bool, notes: list[str] | None = None,
                 exact_definitions: set | None = None):
        self.root = root
        self.closing = closing
        self.notes = [] if notes is None else notes
        draft = root.get("$schema")
        self.ref_siblings_ignored = isinstance(draft, str) and any(d in draft for d in _OLD_DRAFTS)
        # definitions reachable from a oneOf whose branches are not provably disjoint as
        # written: only exact rewrites there (check_schema's proof must see them unnarrowed)
        self.exact_definitions = (_definitions_below_one_ofs(root, only_open=True)
                                  if exact_definitions is None else exact_definitions)
        self._validator = None
        self._budget = 256  # $ref inlines: a recursive schema must not grow without end

    def _format_with_length(self, node: dict, exact: bool) -> Any:
        try:
            out = format_with_length(node)
        except Unmergeable:
            return formats.format_with_length(self, node, exact)
        if "pattern" in out:  # common addresses for an email: narrower
            if exact:
                raise Unmergeable("format with a length: narrower")
            self.note("format with a length (common values)")
        return out

    def note(self, rule: str) -> None:
        """Record that a narrowing (not exact) rewrite ran."""
        self.notes.append(rule)

    def run(self, exact: bool = False) -> Any:
        return self.lower(self.root, frozenset(), 0, exact)

    def _spend(self) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise Unmergeable("too many '$ref' inlines")

    # --- walk -------------------------------------------------------------------------------

    def lower(self, node: Any, inlined: frozenset[str], depth: int, exact: bool) -> Any:
        if not isinstance(node, dict) or depth > 64:
            return node
        # The root's definitions stay at the root whatever its rewrites make of it (an anyOf of
        # cases, a merged branch): references resolve there, and nowhere else.
        root_defs = {k: node[k] for k in ("definitions", "$defs") if k in node} if depth == 0 else {}
        if root_defs:
            node = without(node, *root_defs)
        for _ in range(16):  # a rewrite may expose another (a merged $ref target with allOf, ...)
            rewritten, inlined = self._rewrite(node, inlined, exact)
            if rewritten is node:
                break
            node = rewritten
            if not isinstance(node, dict):
                if node is True and root_defs:
                    node = {}
                    break
                return node
        if root_defs:
            node = {**root_defs, **without(node, *root_defs)}
        out = dict(node)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                defs = key in ("definitions", "$defs") and depth == 0
                out[key] = {k: self.lower(v, inlined, depth + 1, exact or (
                                defs and (True in self.exact_definitions or (key, k) in self.exact_definitions)))
                            for k, v in node[key].items()}
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                out[key] = [self.lower(v, inlined, depth + 1, exact or key == "oneOf")
                            for v in node[key]]
        for key in COMBINATORS:  # a branch that never matches changes no count: drop it
            if isinstance(out.get(key), list) and False in out[key]:
                live = [v for v in out[key] if v is not False]
                if not live:
                    return False
                out[key] = live
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                out[key] = self.lower(node[key], inlined, depth + 1, exact)
        if isinstance(node.get("items"), list):
            out["items"] = [self.lower(v, inlined, depth + 1, exact) for v in node["items"]]
        if out.get("additionalProperties") is False and "propertyNames" in out and not out.get(
                "properties") and not out.get("patternProperties"):
            # no key is allowed at all: xgrammar would read propertyNames as letting keys in
            out = without(out, "propertyNames")
        props = out.get("properties")
        if is_object(out) and isinstance(props, dict) and False in props.values():
            try:  # a property lowered to false: only absent will do
                return object_rules(self, out, inlined, exact)
            except _CANNOT:
                pass
        return out

    def _rewrite(self, node: dict, inlined: frozenset[str], exact: bool) -> tuple[Any, frozenset[str]]:
        """One rewrite of `node` itself, or `node` unchanged (same object)."""
        try:
            if node.get("not") in ({}, True):
                return False, inlined  # `not` of everything: nothing matches
            if isinstance(node.get("items"), list) and "prefixItems" not in node:
                # draft 4-2019 tuple form (xgrammar reads only the 2020-12 one): the same meaning
                rest = without(node, "items", "additionalItems")
                tail = node.get("additionalItems", True)
                return {**rest, "prefixItems": node["items"], **({} if tail is True else {"items": tail})}, inlined
            if isinstance(node.get("oneOf"), list) and "anyOf" not in node and disjoint_as_written(
                    self.root, node["oneOf"]):
                # at most one branch matches any instance: oneOf means anyOf, and below an
                # anyOf narrowing is sound
                return {**without(node, "oneOf"), "anyOf": node["oneOf"]}, inlined
            if (isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1
                    and not assertions(node, "oneOf")):
                rewritten = shared_singletons(self, node, inlined)  # exact
                if rewritten is not node:
                    return rewritten, inlined
            if "if" in node or "then" in node or "else" in node:
                return if_then_else(self, node, inlined), inlined  # exact (conditionals.py)
            if "$ref" in node and assertions(node, "$ref"):
                ref = node["$ref"]
                if self.ref_siblings_ignored:  # what drafts 4-7 say, and what jsonschema does
                    return {k: v for k, v in node.items()
                            if k == "$ref" or k in NON_ASSERTIONS}, inlined
                if ref in inlined:
                    return node, inlined
                self._spend()
                rest = without(node, "$ref")
                return self.merge(self.resolve(ref), rest, inlined | {ref}), inlined | {ref}
            if "allOf" in node:
                out: Any = without(node, "allOf")
                for sub in node["allOf"]:
                    out = self.merge(out, sub, inlined)
                return out, inlined
            comb = next((c for c in COMBINATORS if c in node), None)
            if comb and assertions(node, comb):
                return self._distribute(node, comb, inlined), inlined
            if ("enum" in node or "const" in node) and assertions(node, "enum", "const"):
                return merge({k: v for k, v in node.items() if k in ("enum", "const")},
                             without(node, "enum", "const"), self.keep_valid), inlined
            if isinstance(node.get("not"), dict) and set(node["not"]) == {"type"}:
                return not_type(node), inlined
            if "not" in node and node.get("type") in ("string", ["string"], "integer", ["integer"]):
                try:
                    return not_literals(self, node, inlined), inlined
                except Unmergeable:
                    pass  # other rules may still apply; check_schema refuses the `not`
            if isinstance(node.get("not"), dict) and node.get("type") not in (
                    "string", ["string"], "integer", ["integer"]):
                try:
                    return not_values_by_type(self, node, inlined), inlined  # exact
                except Unmergeable:
                    pass
            if whole_step(node):
                return integer_steps(node), inlined
            if fractional_step(node):
                return fractional_steps(self, node, exact), inlined
            if integer_bounds_to_fix(node):
                return integer_bounds(self, node), inlined
            if string_keywords_without_type(node) and not exact:
                self.note("string keywords without a type")
                return {**node, "type": "string"}, inlined  # narrower: other types pass them
            if object_keywords_without_type(node) and not exact:
                self.note("object keywords without a type")
                return {**node, "type": "object"}, inlined  # narrower: other types pass them
            if isinstance(node.get("propertyNames"), dict) and "$ref" in node["propertyNames"]:
                # check_schema reads propertyNames as a string schema: the target inlined
                return {**node, "propertyNames": self.plain(node["propertyNames"], inlined)}, inlined
            if number_keywords_without_type(node) and not exact:
                self.note("number keywords without a type")
                return {**node, "type": "number"}, inlined  # narrower: other types pass them
            if node.get("format") in formats.UNENFORCED and not exact and not any(
                    k in node for k in ("pattern", "minLength", "maxLength")) and node.get("type") is not None:
                return formats.unenforced_format(self, node, exact), inlined
            if node.get("format") in STANDARD_FORMATS and "pattern" in node:
                return format_with_pattern(self, node, exact), inlined
            if "format" in node and "pattern" not in node and (
                    "minLength" in node or "maxLength" in node):
                return self._format_with_length(node, exact), inlined
            if "pattern" in node and ("minLength" in node or "maxLength" in node):
                return pattern_with_length(self, node), inlined
            if isinstance(node.get("pattern"), str) and ("^" in node["pattern"] or "$" in node["pattern"]):
                rewritten = pattern_anchors(node)
                if rewritten is not node:
                    return rewritten, inlined
            if (typed_object(node) and forbids_undeclared(node) and isinstance(node.get("minProperties"), int)
                    and node["minProperties"] > len(node.get("properties") or {})):
                return False, inlined  # needs more keys than it allows
            if isinstance(node.get("type"), list) and "object" in node["type"] and len(node["type"]) > 1 and (
                    node.get("patternProperties") or any(node.get(k) for k in (
                        "dependencies", "dependentRequired", "dependentSchemas")) or _undeclared_required(node)
            ) and not assertions(
                    node, "type", *OBJECT_KEYWORDS) and not exact:
                # exact: object keywords apply to objects only; each type gets its own branch
                # (no rule reads anyOf branches as written, so below a oneOf it waits)
                others = [t for t in node["type"] if t != "object"]
                notes = {k: v for k, v in node.items() if k in NON_ASSERTIONS}
                return {**notes, "anyOf": [{**without(node, *NON_ASSERTIONS), "type": "object"},
                                           {"type": others[0] if len(others) == 1 else others}]}, inlined
            if node.get("uniqueItems") is True:
                try:
                    return unique_items(self, node, inlined), inlined  # exact (unique_items.py)
                except Unmergeable:
                    pass  # check_schema refuses it by name
            if is_object(node):
                rewritten = object_rules(self, node, inlined, exact)
                if rewritten is not node:
                    return rewritten, inlined
            if comb == "oneOf" and len(node["oneOf"]) > 1:
                return disjoint_one_of(self, node, inlined, exact), inlined
        except _CANNOT:
            pass
        return node, inlined

    # --- what the rule modules use ----------------------------------------------------------

    def closed(self, node: dict) -> bool:
        """No key beyond `properties` (patternProperties would let more in)."""
        if node.get("patternProperties"):
            return False
        ap = node.get("additionalProperties")
        return ap is False or (self.closing and ap is None and closes(node))

    def merge(self, a: Any, b: Any, inlined: frozenset[str]) -> Any:
        """allOf [a, b] as one schema: references inlined, anyOf/oneOf distributed."""
        a, b = self.plain(a, inlined), self.plain(b, inlined)
        if all(isinstance(x, dict) and any(k in x for k in ("if", "then", "else")) for x in (a, b)):
            # two conditions do not merge as keywords: one of them as its cases (conditionals.py)
            a = self.plain(if_then_else(self, a, inlined), inlined)
        for first, (x, y) in ((True, (a, b)), (False, (b, a))):
            if isinstance(x, dict):
                comb = next((c for c in COMBINATORS if c in x), None)
                if comb:
                    rest = without(x, comb)
                    # (a's keys first in every branch: the properties keep their written order)
                    branches = [self.merge(self.merge(rest, br, inlined), y, inlined) if first else
                                self.merge(y, self.merge(rest, br, inlined), inlined) for br in x[comb]]
                    return combinator(comb, branches)
        return merge(a, b, self.keep_valid)

    def plain(self, node: Any, inlined: frozenset[str]) -> Any:
        """`node` without `$ref` or `allOf` at its top (inlined, merged)."""
        for _ in range(8):
            if not isinstance(node, dict):
                return node
            if "$ref" in node:
                ref = node["$ref"]
                if ref in inlined:
                    raise Unmergeable(f"recursive '$ref' {ref}")
                inlined = inlined | {ref}
                self._spend()
                rest = without(node, "$ref")
                if self.ref_siblings_ignored:
                    rest = {}
                node = self.merge(self.resolve(ref), rest, inlined) if rest else self.resolve(ref)
                continue
            if "allOf" in node:
                out: Any = without(node, "allOf")
                for sub in node["allOf"]:
                    out = self.merge(out, sub, inlined)
                node = out
                continue
            return node
        raise Unmergeable("references too deep")

    def _distribute(self, node: dict, comb: str, inlined: frozenset[str]) -> Any:
        rest = {k: v for k, v in node.items() if k != comb and k not in NON_ASSERTIONS}
        notes = {k: v for k, v in node.items() if k in NON_ASSERTIONS}
        out = combinator(comb, [self.merge(rest, br, inlined) for br in node[comb]])
        # (one branch left is the node itself: it keeps the notes too, the root's definitions
        # among them, or the references into them would no longer resolve)
        return {**notes, **out} if isinstance(out, dict) else out

    def resolve(self, ref: str) -> Any:
        if ref == "#":
            return self.root
        _, kind, name = ref.split("/", 2)
        target = (self.root.get(kind) or {}).get(name.replace("~1", "/").replace("~0", "~"))
        if target is None:
            raise Unmergeable(f"'$ref' {ref} does not resolve")
        return target

    def keep_valid(self, values: list, schema: dict) -> list:
        """The literals that satisfy `schema` (its $refs resolved against the root)."""
        if self._validator is None:
            import jsonschema

            # the draft the schema names, else the newest (what the compliance check uses too)
            cls = jsonschema.validators.validator_for(self.root)
            self._validator = cls(self.root)
        try:
            check = self._validator.evolve(schema=schema)
            return [v for v in values if check.is_valid(v)]
        except Exception as err:  # a schema jsonschema cannot read: leave it to check_schema
            raise Unmergeable(f"literal filter: {err}") from None


def _without_false_properties(node: Any, closing: bool, notes: list[str] | None) -> Any:
    """Optional properties whose schema is false dropped from objects that allow no other key
    (absent is the only way to meet false there, and xgrammar refuses a false schema); an
    object that allows other keys is closed too (narrower: noted)."""
    if isinstance(node, list):
        return [_without_false_properties(v, closing, notes) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in VALUE_KEYS else
               {n: _without_false_properties(s, closing, notes) for n, s in v.items()}
               if k == "properties" and isinstance(v, dict) else _without_false_properties(v, closing, notes))
           for k, v in node.items()}
    props = out.get("properties")
    if isinstance(props, dict) and False in props.values() and not node.get("patternProperties"):
        required = out.get("required") if isinstance(out.get("required"), list) else []
        ap = node.get("additionalProperties")
        kept = {n: s for n, s in props.items() if s is not False or n in required}
        if other_names(node):  # its other keys leave the declared names out: absent it is
            out["properties"] = kept
        elif ap is False or (closing and ap is None and closes({**node, "properties": kept}) and kept):
            out["properties"] = kept
            out["additionalProperties"] = False
        elif notes is not None and all(s is not False for s in kept.values()) and not node.get("propertyNames"):
            notes.append("false property on an open object (closed)")
            out["properties"] = kept
            out["additionalProperties"] = False
    return out


def _definitions_below_one_ofs(root: dict, only_open: bool) -> set:
    """(kind, name) of every definition a `oneOf` (with `only_open`: one not provably disjoint
    as written) reaches through references (`True` in the set: one reaches `#`, the whole
    schema)."""
    open_branches: list = []
    stack: list = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("oneOf"), list) and not (only_open and disjoint_as_written(root, node["oneOf"])):
                open_branches += node["oneOf"]
            stack += [v for k, v in node.items() if k not in VALUE_KEYS]
        elif isinstance(node, list):
            stack += node
    reached: set = set()
    stack = open_branches
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref == "#":
                return {True}
            if isinstance(ref, str) and _SIMPLE_REF.match(ref):
                _, kind, name = ref.split("/", 2)
                target = root.get(kind)
                if (kind, name) not in reached and isinstance(target, dict) and name in target:
                    reached.add((kind, name))
                    stack.append(target[name])
            stack += [v for k, v in node.items() if k not in VALUE_KEYS]
        elif isinstance(node, list):
            stack += node
    return reached


def _has_open_one_of(root: dict) -> bool:
    """Whether a `oneOf` not provably disjoint as written is left anywhere in `root`."""
    stack: list = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("oneOf"), list) and not disjoint_as_written(root, node["oneOf"]):
                return True
            stack += [v for k, v in node.items() if k not in VALUE_KEYS]
        elif isinstance(node, list):
            stack += node
    return False


def _without_refs_to(node: Any, dead: set[str]) -> Any:
    """`node` with every reference to a `dead` definition replaced by false (and those
    definitions removed)."""
    if isinstance(node, list):
        return [_without_refs_to(v, dead) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("$ref") in dead:
        return False
    out = {}
    for key, value in node.items():
        if key in VALUE_KEYS:
            out[key] = value
        elif key in ("definitions", "$defs") and isinstance(value, dict):
            out[key] = {n: _without_refs_to(v, dead) for n, v in value.items()
                        if f"#/{key}/{n}" not in dead}
        else:
            out[key] = _without_refs_to(value, dead)
    return out


def _refs_are_simple(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        # only a string is a reference: a `properties` map may name a key "$ref" (an object
        # value), and check_schema refuses a non-string `$ref` in a schema
        if isinstance(ref, str) and not _SIMPLE_REF.match(ref):
            return False
        return all(_refs_are_simple(v) for k, v in node.items()
                   if k not in VALUE_KEYS)
    if isinstance(node, list):
        return all(_refs_are_simple(v) for v in node)
    return True
