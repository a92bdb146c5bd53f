"""A JSON schema xgrammar failed on, turned into a refusal the client can act on.

xgrammar reports its own limits as assertion failures ("Check failed: (false) is false: Integer
exceeds maximum limit ..."); passed on as "invalid json schema" they blame a schema that JSON
Schema accepts. Here the schema is first judged by `jsonschema`'s meta-schema: a schema that
fails it is invalid, with its message and pointer. One that passes is valid JSON Schema that
this engine cannot enforce: the refusal says so (feature "xgrammar") and names the deepest
subschema xgrammar fails on alone, found by converting subschemas one at a time (EBNF only, no
token masks: a few milliseconds each). The raw xgrammar message goes to the log, not the client.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import xgrammar as xgr

from prescient.grammar.errors import GrammarError
from prescient.grammar.schema.nodes import VALUE_KEYS

log = logging.getLogger(__name__)
_MAX_PROBES = 300  # subschemas converted while locating a failure


def schema_failure(original: Any, prepared: Any, err: Exception, options: dict) -> GrammarError:
    """The GrammarError for a schema (`original`, as the client sent it) whose prepared form
    xgrammar refused with `err`; `options` are the compiler's from_json_schema options."""
    log.warning("xgrammar refused a JSON schema: %s", str(err).strip())
    invalid = _meta_schema_error(original)
    if invalid is not None:
        return invalid
    path = _locate(prepared, options)
    return GrammarError("this schema is valid JSON Schema but uses a construct the grammar engine "
                        "cannot compile (details in the server log)", feature="xgrammar", path=path)


def _meta_schema_error(schema: Any) -> GrammarError | None:
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot even read: judged invalid below
        return GrammarError("invalid JSON schema", feature="schema")
    if error is None:
        return None
    pointer = "#" + "".join(f"/{str(p).replace('~', '~0').replace('/', '~1')}" for p in error.absolute_path)
    return GrammarError(f"invalid JSON schema: {error.message[:200]}", feature="schema", path=pointer)


def _locate(root: Any, options: dict) -> str:
    """JSON pointer of the deepest subschema of `root` that fails on its own (with the root's
    definitions beside it, so its references resolve); '#' when none does."""
    if not isinstance(root, dict):
        return "#"
    defs = {k: root[k] for k in ("definitions", "$defs") if isinstance(root.get(k), dict)}
    probes = [0]

    def fails(node: Any) -> bool:
        if not isinstance(node, dict) or probes[0] >= _MAX_PROBES:
            return False
        probes[0] += 1
        try:
            xgr.Grammar.from_json_schema(json.dumps({**node, **{k: v for k, v in defs.items() if k not in node}}),
                                         **options)
            return False
        except Exception:  # noqa: BLE001 - any refusal is what is being looked for
            return True

    def deepest(node: Any, path: str) -> str | None:
        if not fails(node):
            return None
        for sub, sub_path in _children(node, path):
            found = deepest(sub, sub_path)
            if found is not None:
                return found
        return path

    for kind, table in defs.items():  # a failing definition is the place, not its users
        for name, sub in table.items():
            found = deepest(sub, f"#/{kind}/{_escape(name)}")
            if found is not None:
                return found
    return deepest({k: v for k, v in root.items() if k not in defs}, "#") or "#"


def _children(node: dict, path: str):
    for key, value in node.items():
        if key in VALUE_KEYS or key in ("definitions", "$defs"):
            continue
        if key in ("properties", "patternProperties") and isinstance(value, dict):
            for name, sub in value.items():
                yield sub, f"{path}/{key}/{_escape(name)}"
        elif isinstance(value, dict):
            yield value, f"{path}/{_escape(key)}"
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    yield sub, f"{path}/{_escape(key)}/{i}"


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
