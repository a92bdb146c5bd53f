"""Request output formats -> GrammarSpec.

Accepts the Chat Completions `response_format` object and the Responses API `text.format` object:

    {"type": "text"}                                           -> None (unconstrained)
    {"type": "json_object"}                                    -> any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}   (Chat Completions)
    {"type": "json_schema", "name", "schema", "strict"}                    (Responses API)
    {"type": "regex", "regex": "..."}
    {"type": "grammar", "grammar": "..."}                      (xgrammar EBNF, root rule `root`)

Only the shape is checked here; schema features are checked when the grammar is compiled, so
every path into the compiler gets the same checks. `strict` is accepted and needs no handling:
the schema is always enforced in full or refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from prescient.grammar.errors import GrammarError
from prescient.grammar.spec import GrammarSpec, canonical_json


def spec_from_response_format(response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError("response_format must be an object", feature="response_format")
    kind = response_format.get("type")
    # A client's JSON may put any value here; an unhashable one (a list) would be a TypeError
    if kind is not None and not isinstance(kind, str):
        raise GrammarError(f"response_format 'type' must be a string, one of {sorted(_BUILDERS)}; got "
                           f"{type(kind).__name__}", feature="response_format.type")
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise GrammarError(f"unsupported response_format type {kind!r}; expected one of "
                           f"{sorted(_BUILDERS)}", feature="response_format.type")
    return builder(response_format)


def _text(_: Mapping[str, Any]) -> None:
    return None


def _json_object(_: Mapping[str, Any]) -> GrammarSpec:
    return GrammarSpec("json_object", "")


def _json_schema(fmt: Mapping[str, Any]) -> GrammarSpec:
    # Chat Completions nests the schema under "json_schema"; the Responses API puts it inline.
    body = fmt.get("json_schema", fmt)
    if not isinstance(body, Mapping) or "schema" not in body:
        raise GrammarError("json_schema response_format needs a 'schema'",
                           feature="response_format.schema")
    schema = body["schema"]
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError("'schema' must be a JSON object", feature="response_format.schema")
    return GrammarSpec("json_schema", canonical_json(schema))


def _regex(fmt: Mapping[str, Any]) -> GrammarSpec:
    regex = fmt.get("regex", fmt.get("pattern"))
    if not isinstance(regex, str) or not regex:
        raise GrammarError("regex response_format needs a non-empty 'regex' string",
                           feature="response_format.regex")
    return GrammarSpec("regex", regex)


def _grammar(fmt: Mapping[str, Any]) -> GrammarSpec:
    grammar = fmt.get("grammar")
    syntax = fmt.get("syntax", "ebnf")
    if syntax != "ebnf":
        raise GrammarError(f"grammar syntax {syntax!r} is not supported; use 'ebnf'",
                           feature="response_format.syntax")
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("grammar response_format needs a non-empty 'grammar' string",
                           feature="response_format.grammar")
    return GrammarSpec("ebnf", grammar)


_BUILDERS = {
    "text": _text,
    "json_object": _json_object,
    "json_schema": _json_schema,
    "regex": _regex,
    "grammar": _grammar,
}
