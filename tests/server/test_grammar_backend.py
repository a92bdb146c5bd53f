"""`--grammar-backend` end to end on the tiny model: under llguidance a structured output still
validates (speculation on, so draft trees and forced spans go through it), a tool-call grammar is
a 400 naming the backend; under auto the tool call is served (xgrammar) and the schema too."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _structured(client) -> str:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                       response_format=FORMAT, max_tokens=60, temperature=0)
    return r.choices[0].message.content


def test_llguidance_serves_schemas_and_refuses_tool_calls(make_tiny_server):
    client = _client(make_tiny_server(speculate="ngram", grammar_backend="llguidance"))
    jsonschema.validate(json.loads(_structured(client)), WEATHER)
    with pytest.raises(openai.BadRequestError, match="llguidance"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)


def test_auto_serves_both(make_tiny_server):
    client = _client(make_tiny_server(grammar_backend="auto"))
    jsonschema.validate(json.loads(_structured(client)), WEATHER)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_an_unknown_backend_is_refused():
    from prescient.server.context import ServerConfig

    with pytest.raises(ValueError, match="grammar_backend"):
        ServerConfig(grammar_backend="outlines")
