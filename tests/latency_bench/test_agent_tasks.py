"""The agent benchmark's data and rules: the task file, the tool simulator, settlement, call parsing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from prescient.latency_bench.agent_http import parse_hermes
from prescient.latency_bench.agent_tasks import (AgentTask, CallRecord, TaskRecord, load_tasks, load_toolsets,
                                                 openai_tools)
from prescient.latency_bench.tool_sim import ToolSimulator, schema_errors, unsupported_keywords

TOOLSETS = load_toolsets()
TASKS, META = load_tasks(toolsets=TOOLSETS)


# ---------------------------------------------------------------- the task file


def test_task_file_has_enough_varied_tasks():
    assert META["num_tasks"] == len(TASKS) >= 30
    assert len({t.toolset for t in TASKS}) >= 4
    assert all(3 <= t.max_turns <= 6 for t in TASKS)
    assert {len(t.expected_calls) for t in TASKS} >= {1, 2, 3}


def test_every_expected_call_names_a_declared_tool_and_leaves_a_turn_to_answer():
    for t in TASKS:
        declared = {tool["name"] for tool in TOOLSETS[t.toolset]}
        assert set(t.expected_calls) <= declared, t.id
        assert t.max_turns > len(t.expected_calls), t.id
        assert t.tool_choice[-1] != "required", t.id


def test_tool_schemas_are_valid_and_use_only_what_the_simulator_checks():
    for name, tools in TOOLSETS.items():
        assert len({t["name"] for t in tools}) == len(tools), name
        for tool in tools:
            jsonschema.Draft202012Validator.check_schema(tool["parameters"])
            assert tool["parameters"]["type"] == "object"
            assert not unsupported_keywords(tool["parameters"]), tool["name"]
            assert tool["description"]


def test_openai_tools_drop_the_simulator_template():
    for tool in openai_tools(TOOLSETS["weather"]):
        assert set(tool) == {"type", "function"} and set(tool["function"]) == {"name", "description", "parameters"}


def test_a_task_naming_an_undeclared_tool_is_refused_with_its_line(tmp_path):
    good = json.dumps({"id": "a", "toolset": "weather", "user": "hi", "expected_calls": ["get_weather"],
                       "tool_choice": ["required", "auto", "auto"]})
    bad = json.dumps({"id": "b", "toolset": "weather", "user": "hi", "expected_calls": ["book_flight"],
                      "tool_choice": ["required", "auto", "auto"]})
    path = tmp_path / "tasks.jsonl"
    path.write_text(good + "\n" + bad + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: task 'b'.*book_flight"):
        load_tasks(path, TOOLSETS)


def test_a_task_without_a_turn_for_the_answer_is_refused(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "a", "toolset": "weather", "user": "hi", "expected_calls": ["get_weather"],
                                "tool_choice": ["required"]}) + "\n")
    with pytest.raises(ValueError, match="no turn for the final answer"):
        load_tasks(path, TOOLSETS)


# ---------------------------------------------------------------- the simulator

WEATHER = ToolSimulator(TOOLSETS["weather"])


def test_a_valid_call_is_answered_deterministically_from_its_arguments():
    a = WEATHER.call("get_weather", '{"city": "Paris"}')
    assert a.valid and a.error is None
    assert a == WEATHER.call("get_weather", {"city": "Paris"})  # same arguments, same answer
    result = json.loads(a.content)["result"]
    assert result["city"] == "Paris" and -15 <= result["temperature"] <= 38
    others = {WEATHER.call("get_weather", {"city": c}).content for c in ("Oslo", "Lima", "Kyiv", "Pune")}
    assert len(others) > 1  # the answer depends on the arguments


@pytest.mark.parametrize("name,args,why", [
    ("get_wether", '{"city": "Paris"}', "unknown tool 'get_wether'"),
    ("get_weather", '{"city": ', "not JSON"),
    ("get_weather", '["Paris"]', "not a JSON object"),
    ("get_weather", "{}", "missing required 'city'"),
    ("get_weather", '{"city": 3}', "expected string"),
    ("get_weather", '{"city": "Paris", "unit": "kelvin"}', "not one of"),
    ("get_weather", '{"city": "Paris", "when": "now"}', "unexpected property 'when'"),
    ("get_forecast", '{"city": "Rome", "days": 9}', "maximum 7"),
    ("get_forecast", '{"city": "Rome", "days": 2.5}', "expected integer"),
])
def test_a_bad_call_gets_an_error_result_and_is_invalid(name, args, why):
    r = WEATHER.call(name, args)
    assert not r.valid and why in r.error
    assert json.loads(r.content)["error"] == r.error


def test_schema_check_agrees_with_jsonschema_on_every_tool():
    values = [None, True, 0, -3, 2.5, 10 ** 6, "", "ab", "abc", "2026-12-24", "celsius", [], {}]
    for tools in TOOLSETS.values():
        for tool in tools:
            schema = tool["parameters"]
            props = list(schema["properties"])
            candidates = [{}, {p: v for p in props for v in [values[len(p) % len(values)]]}]
            for p in props:
                for v in values:
                    candidates.append({q: "x" * 3 for q in schema["required"]} | {p: v})
            for c in candidates:
                ours = not schema_errors(c, schema)
                theirs = jsonschema.Draft202012Validator(schema).is_valid(c)
                assert ours == theirs, (tool["name"], c)


# ---------------------------------------------------------------- settlement

TASK = AgentTask("t", "weather", "hi", ("get_weather", "get_weather", "get_forecast"),
                 ("required", "required", "required", "auto", "auto"))


def record(calls, final_turn=3, error=None) -> TaskRecord:
    rec = TaskRecord(TASK, [CallRecord(i, n, "{}", ok) for i, (n, ok) in enumerate(calls)], error=error)
    if final_turn is not None:
        rec.final_answer, rec.final_turn = "done", final_turn
    return rec


def test_settled_needs_every_expected_call_no_invalid_call_and_an_answer():
    ok = [("get_weather", True), ("get_forecast", True), ("get_weather", True)]
    assert record(ok).settled and record(ok).verdict == "settled"
    assert record(ok + [("get_air_quality", True)]).settled  # an extra valid call does not unsettle
    one_weather = record(ok[:2])
    assert not one_weather.settled and one_weather.missing_calls == ["get_weather"]  # multiplicity counts
    invalid = record(ok + [("get_weather", False)])
    assert not invalid.settled and invalid.verdict == "invalid call"
    an_invalid_expected = record([("get_weather", True), ("get_forecast", True), ("get_weather", False)])
    assert an_invalid_expected.missing_calls == ["get_weather"]  # an invalid call satisfies nothing
    assert record(ok, final_turn=None).verdict == "no final answer"
    assert not record(ok, final_turn=5).settled  # past the turn limit (turns 0..4)
    assert record(ok, error="turn 2: boom").verdict == "error"


# ---------------------------------------------------------------- client-side call parsing


def test_hermes_calls_are_parsed_and_broken_markup_is_kept_as_malformed():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>\n<tool_call>\n{"name": "x"')
    head, calls, malformed = parse_hermes(text)
    assert head == "Let me check."
    assert calls == [("get_weather", '{"city": "Oslo"}')]
    assert len(malformed) == 2  # the bad JSON and the call cut before its close tag
    assert parse_hermes("Sunny, 20 degrees.") == ("Sunny, 20 degrees.", [], [])
