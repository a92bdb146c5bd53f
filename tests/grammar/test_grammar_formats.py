"""Request formats -> GrammarSpec: Chat Completions response_format, Responses API text.format."""

from __future__ import annotations

import json

import pytest

from prescient.grammar import GrammarError, GrammarSpec, spec_from_response_format

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}


def test_text_means_unconstrained():
    assert spec_from_response_format(None) is None
    assert spec_from_response_format({"type": "text"}) is None


def test_chat_and_responses_json_schema_share_one_spec():
    chat = {"type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    responses = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": False}
    spec = spec_from_response_format(chat)
    assert spec == spec_from_response_format(responses)
    assert spec.kind == "json_schema"
    # property order is kept (xgrammar emits properties in declared order)
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]


def test_json_object_regex_grammar():
    assert spec_from_response_format({"type": "json_object"}) == GrammarSpec("json_object", "")
    assert spec_from_response_format({"type": "regex", "regex": "a+"}) == GrammarSpec("regex", "a+")
    ebnf = 'root ::= "yes" | "no"'
    assert spec_from_response_format({"type": "grammar", "grammar": ebnf}) == GrammarSpec(
        "ebnf", ebnf)


@pytest.mark.parametrize("fmt,feature", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": ["json_object"]}, "response_format.type"),  # unhashable: was a TypeError
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.schema"),
    ({"type": "json_schema", "schema": "not a schema"}, "response_format.schema"),
    ({"type": "regex"}, "response_format.regex"),
    ({"type": "grammar", "grammar": "start: x", "syntax": "lark"}, "response_format.syntax"),
    ("json", "response_format"),
])
def test_malformed_formats_are_refused(fmt, feature):
    with pytest.raises(GrammarError) as info:
        spec_from_response_format(fmt)
    assert info.value.feature == feature


def test_spec_rejects_unknown_kind():
    with pytest.raises(ValueError):
        GrammarSpec("lark", "start: x")
