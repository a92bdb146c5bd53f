"""Every `$ref` made local and simple (`#` or `#/definitions/<name>`) before lowering (lower.py).

The lowering moves subschemas (merges, distributes), so a reference into one (`#/properties/a`,
`#/definitions/a/definitions/b`) could end up pointing at something else. Real schemas also name
targets by id: `"$ref": "#node"` with `"id": "#node"` (draft 4) or `"$anchor": "node"`, and by the
root's absolute id (`"$ref": "http://x/s.json#/definitions/a"` under `"$id": "http://x/s.json"`).
Each such target is resolved once in the original schema and copied into the definitions under
a fresh name; the reference then names the copy. The copy is the same subschema, so validation
is unchanged, and copies of recursive targets refer to themselves through the same names.

A reference that leaves the document (another file) or does not resolve raises GrammarError
naming it and the JSON pointer where it sits; a schema with embedded resources (a subschema `$id`
with its own base URI) is left as it is: references inside it resolve against that base, and
check.py refuses what does not resolve locally.
"""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import unquote, urldefrag

from prescient.grammar.errors import GrammarError
from prescient.grammar.schema.nodes import VALUE_KEYS

_SIMPLE = re.compile(r"^#(/(definitions|\$defs)/[^/]+)?$")
_HOIST_PREFIX = "prescient_ref_"


def localize_refs(schema: Any) -> Any:
    """`schema` with every reference simple (a copy when any changed); see the module doc."""
    if not isinstance(schema, dict):
        return schema
    refs = _refs(schema, "#")
    if all(_SIMPLE.match(ref) and _plain_name(schema, ref) for ref, _ in refs):
        return schema
    if _has_embedded_resources(schema):
        return schema
    return _Localizer(schema).run()


class _Localizer:
    def __init__(self, root: dict):
        self.root = root
        self.base = _base(root)
        self.kind = "$defs" if "$defs" in root and "definitions" not in root else "definitions"
        if not isinstance(root.get(self.kind, {}), dict):
            raise GrammarError(f"'{self.kind}' must be an object", feature="schema", path="#")
        self.anchors = _anchors(root)
        self.names: dict[str, str] = {}  # canonical pointer -> hoisted definition name
        self.hoisted: dict[str, Any] = {}

    def run(self) -> dict:
        out = self._rewrite(self.root, "#")
        pending = list(self.names.items())
        done: set[str] = set()
        while pending:  # a hoisted target may itself hold references to hoist
            pointer, name = pending.pop()
            if name in done:
                continue
            done.add(name)
            before = set(self.names)
            self.hoisted[name] = self._rewrite(copy.deepcopy(self._target(pointer, pointer)), pointer)
            pending += [(p, self.names[p]) for p in self.names if p not in before]
        defs = dict(out.get(self.kind) or {})
        defs.update(self.hoisted)
        out[self.kind] = defs
        return out

    def _rewrite(self, node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [self._rewrite(v, f"{path}/{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in VALUE_KEYS:
                out[key] = value
            elif key == "$ref" and isinstance(value, str):
                out[key] = self._simple(value, path)
            elif key == "properties" and isinstance(value, dict):  # names are not keywords
                out[key] = {k: self._rewrite(v, f"{path}/properties/{_escape(k)}") for k, v in value.items()}
            else:
                out[key] = self._rewrite(value, f"{path}/{_escape(key)}")
        return out

    def _simple(self, ref: str, path: str) -> str:
        pointer = self._pointer(ref, path)
        if _SIMPLE.match(pointer) and _plain_name(self.root, pointer):
            return pointer
        self._target(pointer, path)  # resolves, or GrammarError naming it
        if pointer not in self.names:
            used = set(self.root.get(self.kind) or {}) | set(self.names.values())
            i = len(self.names)
            while f"{_HOIST_PREFIX}{i}" in used:
                i += 1
            self.names[pointer] = f"{_HOIST_PREFIX}{i}"
        return f"#/{self.kind}/{self.names[pointer]}"

    def _pointer(self, ref: str, path: str) -> str:
        """The `#/...` JSON pointer `ref` names in this document."""
        uri, fragment = urldefrag(ref)
        if uri and uri != self.base:
            raise GrammarError(f"'$ref' {ref!r} names another document (only references inside "
                               "the schema resolve)", feature="$ref", path=path)
        if fragment == "" or fragment.startswith("/"):
            return "#" + unquote(fragment)
        if fragment in self.anchors:
            return self.anchors[fragment]
        raise GrammarError(f"'$ref' {ref!r} does not resolve (no subschema has that id or "
                           "anchor)", feature="$ref", path=path)

    def _target(self, pointer: str, path: str) -> Any:
        target: Any = self.root
        for part in pointer[2:].split("/") if pointer != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise GrammarError(f"'$ref' {pointer!r} does not resolve", feature="$ref", path=path)
        return target


def _refs(node: Any, path: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    stack = [(node, path)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                out.append((ref, path))
            stack += [(v, f"{path}/{k}") for k, v in node.items() if k not in VALUE_KEYS]
        elif isinstance(node, list):
            stack += [(v, f"{path}/{i}") for i, v in enumerate(node)]
    return out


def _plain_name(root: dict, pointer: str) -> bool:
    """A `#/definitions/<name>` whose name needs no unescaping and exists (or `#`)."""
    if pointer == "#":
        return True
    _, kind, name = pointer.split("/", 2)
    return "~" not in name and "%" not in name and isinstance(root.get(kind), dict) and name in root[kind]


def _base(root: dict) -> str:
    for key in ("$id", "id"):
        value = root.get(key)
        if isinstance(value, str):
            return urldefrag(value)[0]
    return ""


def _anchors(root: dict) -> dict[str, str]:
    """Plain-name fragments -> the pointer of the subschema they name (`id`/`$id` "#name",
    `$anchor`)."""
    out: dict[str, str] = {}
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key in ("$id", "id"):
                value = node.get(key)
                if isinstance(value, str) and value.startswith("#") and not value.startswith("#/") and len(value) > 1:
                    out.setdefault(value[1:], path)
            if isinstance(node.get("$anchor"), str):
                out.setdefault(node["$anchor"], path)
            for k, v in node.items():
                if k in VALUE_KEYS:
                    continue
                if k == "properties" and isinstance(v, dict):
                    stack += [(s, f"{path}/properties/{_escape(n)}") for n, s in v.items()]
                else:
                    stack.append((v, f"{path}/{_escape(k)}"))
        elif isinstance(node, list):
            stack += [(v, f"{path}/{i}") for i, v in enumerate(node)]
    return out


def _has_embedded_resources(root: dict) -> bool:
    """A subschema whose `$id` sets another base URI (references inside it resolve there)."""
    base = _base(root)
    stack: list[Any] = [v for k, v in root.items() if k not in VALUE_KEYS]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("$id", "id"):
                value = node.get(key)
                # `id` is also a common property *name*: only a string value counts, and only
                # one that names a document (not a bare fragment, not the root's own URI)
                if isinstance(value, str) and not value.startswith("#") and urldefrag(value)[0] not in ("", base):
                    if "$ref" in str(node):
                        return True
            stack += [v for k, v in node.items() if k not in VALUE_KEYS]
        elif isinstance(node, list):
            stack += node
    return False


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
