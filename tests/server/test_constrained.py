"""Structured output and tool calls on the tiny model: whatever the random weights prefer, the
grammar makes every output valid, and tool calls stream as function_call items."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import websockets

from tests.server.test_responses_ws import create, deltas, until_terminal

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": {
                  "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
                  "additionalProperties": False}}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in CHAT_TOOLS}


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)


def test_chat_tool_call_required_validates(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=CHAT_TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_chat_named_tool_streamed_validates(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=CHAT_TOOLS, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(tc.index, {"name": None, "args": ""})
            if tc.function.name:
                assert call["name"] is None  # the name comes once, when it is fixed
                call["name"] = tc.function.name
            call["args"] += tc.function.arguments or ""
    assert [c["name"] for c in calls.values()] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["args"]), SCHEMAS["get_time"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_response_format_json_schema_validates(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


def test_regex_format_extension(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(text={"format": {"type": "regex", "regex": "[0-9]{3}-[a-z]{2,4}"}},
                                 max_output_tokens=30))
            return await until_terminal(ws)

    events = asyncio.run(go())
    assert events[-1]["type"] == "response.completed"
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", "".join(e["delta"] for e in deltas(events)))


def test_ws_json_schema_stream_concatenates_to_valid_json(tiny):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}

    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(text={"format": fmt}, max_output_tokens=80, input="Give me JSON"))
            return await until_terminal(ws)

    events = asyncio.run(go())
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in deltas(events))
    jsonschema.validate(json.loads(text), WEATHER)
    assert events[-1]["response"]["text"]["format"]["name"] == "weather"


def test_ws_function_call_items_stream_and_the_loop_continues(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(input="Weather in Oslo?", tools=RESPONSES_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80))
            turn1 = await until_terminal(ws)
            call = next(e["item"] for e in turn1 if e["type"] == "response.output_item.done")
            await ws.send(create(previous_response_id=turn1[-1]["response"]["id"], tools=RESPONSES_TOOLS,
                                 tool_choice="none", max_output_tokens=4,
                                 input=[{"type": "function_call_output", "call_id": call["call_id"],
                                         "output": json.dumps({"temp_c": 3})}]))
            return turn1, await until_terminal(ws)

    turn1, turn2 = asyncio.run(go())
    types = [e["type"] for e in turn1]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    added = turn1[2]["item"]
    assert added["type"] == "function_call" and added["name"] in SCHEMAS and added["arguments"] == ""
    args_deltas = deltas(turn1, "response.function_call_arguments.delta")
    done = next(e for e in turn1 if e["type"] == "response.function_call_arguments.done")
    assert "".join(e["delta"] for e in args_deltas) == done["arguments"]
    assert all(e["item_id"] == added["id"] for e in args_deltas)
    final = turn1[-1]["response"]
    assert turn1[-1]["type"] == "response.completed" and len(final["output"]) == 1
    item = final["output"][0]
    assert item["status"] == "completed" and item["arguments"] == done["arguments"]
    jsonschema.validate(json.loads(item["arguments"]), SCHEMAS[item["name"]])
    # Every generated token is accounted for, the call's scaffolding included.
    reported = args_deltas + [turn1[-1]]
    assert sum(e["num_tokens"] for e in reported) == final["usage"]["output_tokens"]
    # Turn 2 continues the conversation from the cached prefix.
    u1, u2 = final["usage"], turn2[-1]["response"]["usage"]
    assert u2["input_tokens_details"]["cached_tokens"] >= u1["input_tokens"] + u1["output_tokens"] - 16


def test_tool_choice_auto_output_is_text_or_well_formed_calls(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=CHAT_TOOLS,
                                       max_tokens=40, temperature=0)
    message = r.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
