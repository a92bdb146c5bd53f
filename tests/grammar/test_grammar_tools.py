"""Tool-call grammars (required / named / auto) and the hermes tool-call parser."""

from __future__ import annotations

import json

import pytest

from prescient.grammar import (
    ContentDelta,
    GrammarError,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolCallStreamParser,
    call_header,
    parse_tool_calls,
    spec_from_tool_choice,
    tools_from_request,
)

from .conftest import accepts_text

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "name": "add",  # Responses API shape
       "parameters": {"type": "object",
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
TOOLS = tools_from_request([WEATHER, ADD])


def call(name: str, arguments: dict) -> str:
    return f"{call_header(name)}{json.dumps(arguments)}}}\n</tool_call>"


W1 = call("get_weather", {"city": "oslo", "unit": "c"})
A1 = call("add", {"a": 1, "b": 2})
UNDECLARED = call("delete_all", {"city": "oslo"})
BAD_ARGS = call("get_weather", {"unit": "c"})  # required "city" missing


def grammar(compiler, choice, parallel=True):
    spec = spec_from_tool_choice(TOOLS, choice, parallel_tool_calls=parallel)
    return compiler.compile(spec)


def accepts(compiler, tokenizer, choice, text, parallel=True) -> bool:
    return accepts_text(grammar(compiler, choice, parallel).matcher(), tokenizer, text)


@pytest.mark.parametrize("text,ok", [
    (W1, True), (A1, True), (W1 + "\n" + A1, True),
    ("", False), ("hi " + W1, False), (UNDECLARED, False), (BAD_ARGS, False), (W1 + " bye", False),
])
def test_required(toy_compiler, toy_tokenizer, text, ok):
    assert accepts(toy_compiler, toy_tokenizer, "required", text) == ok


def test_required_without_parallel_calls_allows_one(toy_compiler, toy_tokenizer):
    assert accepts(toy_compiler, toy_tokenizer, "required", W1, parallel=False)
    assert not accepts(toy_compiler, toy_tokenizer, "required", W1 + "\n" + A1, parallel=False)


@pytest.mark.parametrize("text,ok", [
    (A1, True), (W1, False), (A1 + "\n" + A1, False), (call("add", {"a": 1}), False),
])
def test_named(toy_compiler, toy_tokenizer, text, ok):
    choice = {"type": "function", "function": {"name": "add"}}
    assert accepts(toy_compiler, toy_tokenizer, choice, text) == ok


@pytest.mark.parametrize("text,ok", [
    ("just text", True), ("", True), ("ok " + W1, True), (W1 + " then " + A1 + " done", True),
    ("x " + UNDECLARED, False), ("x " + BAD_ARGS, False),
    ("x <tool_call>\nhello", False),  # once a call starts it must be well-formed
])
def test_auto(toy_compiler, toy_tokenizer, text, ok):
    assert accepts(toy_compiler, toy_tokenizer, "auto", text) == ok


def test_arguments_get_the_response_format_treatment(toy_compiler, toy_tokenizer):
    """Same checks and closing as response_format: `add` declares a and b, so "c" is out;
    a tool that opts in to extra keys gets them."""
    assert not accepts(toy_compiler, toy_tokenizer, "required",
                       call("add", {"a": 1, "b": 2, "c": 3}))
    tools = tools_from_request([{"type": "function", "function": {"name": "kv", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}},
        "additionalProperties": True}}}])
    grammar = toy_compiler.compile(spec_from_tool_choice(tools, "required"))
    assert accepts_text(grammar.matcher(), toy_tokenizer, call("kv", {"a": 1, "b": [2]}))


def test_real_tokenizer_auto_call(real_compiler, real_tokenizer):
    text = "Let me check. " + W1
    assert accepts_text(grammar(real_compiler, "auto").matcher(), real_tokenizer, text)
    assert not accepts_text(grammar(real_compiler, "auto").matcher(), real_tokenizer,
                            "Let me check. " + UNDECLARED)


def test_tool_choice_resolution():
    assert spec_from_tool_choice(TOOLS, "none") is None
    assert spec_from_tool_choice([], "auto") is None
    assert spec_from_tool_choice(TOOLS, None) == spec_from_tool_choice(TOOLS, "auto")
    named = spec_from_tool_choice(TOOLS, {"type": "function", "name": "add"})
    assert [t["name"] for t in json.loads(named.source)["tools"]] == ["add"]
    with pytest.raises(GrammarError, match="not a declared tool"):
        spec_from_tool_choice(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GrammarError, match="at least one tool"):
        spec_from_tool_choice([], "required")
    with pytest.raises(GrammarError):
        spec_from_tool_choice(TOOLS, "sometimes")


def test_tool_declarations_are_validated():
    (no_params,) = tools_from_request([{"type": "function", "function": {"name": "ping"}}])
    assert no_params.parameters["additionalProperties"] is False
    for bad in ([{"type": "function", "function": {"name": 'a"b'}}],
                [{"type": "web_search"}],
                [WEATHER, WEATHER]):
        with pytest.raises(GrammarError):
            tools_from_request(bad)


def test_refused_argument_schema_names_tool_and_feature(toy_compiler):
    tools = tools_from_request([{"type": "function", "function": {
        "name": "tag", "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}])
    with pytest.raises(GrammarError, match="tool 'tag'.*uniqueItems") as info:
        toy_compiler.compile(spec_from_tool_choice(tools, "required"))
    assert info.value.feature == "uniqueItems"


# --- parsing --------------------------------------------------------------------------------

TRICKY = {"q": 'a "quoted" } { [ brace \\', "n": [1, {"x": None}], "t": True}
OUTPUT = "Sure.\n" + call("search", TRICKY) + "\n" + call("add", {"a": 1, "b": 2}) + "\nDone"


def test_parse_tool_calls():
    parsed = parse_tool_calls(OUTPUT)
    assert [c.name for c in parsed.tool_calls] == ["search", "add"]
    assert json.loads(parsed.tool_calls[0].arguments) == TRICKY
    assert parsed.tool_calls[1].arguments == '{"a": 1, "b": 2}'
    assert parsed.content == "Sure.\n\nDone"  # the "\n" between the calls is markup
    assert parse_tool_calls(W1 + "\n" + A1).content == ""


def test_parse_leaves_malformed_calls_as_content():
    text = "a <tool_call>\nnot json</tool_call> b"
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == [] and parsed.content == text
    unfinished = parse_tool_calls(call_header("add") + '{"a": 1')
    assert unfinished.tool_calls == []


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_stream_parser_reports_name_once_fixed_then_argument_deltas(chunk):
    parser = ToolCallStreamParser()
    events = []
    for i in range(0, len(OUTPUT), chunk):
        prefix_end = i + chunk
        events += parser.feed(OUTPUT[i:prefix_end])
        # a name is reported only once its whole header has been generated
        for event in events:
            if isinstance(event, ToolCallStart):
                header = call_header(event.name)
                assert OUTPUT[:prefix_end].count(header) >= 1
    events += parser.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(e.index, e.name) for e in starts] == [(0, "search"), (1, "add")]
    assert [e.index for e in events if isinstance(e, ToolCallEnd)] == [0, 1]
    for index, call_ in enumerate(parse_tool_calls(OUTPUT).tool_calls):
        streamed = "".join(e.text for e in events
                           if isinstance(e, ToolCallArgumentsDelta) and e.index == index)
        assert streamed == call_.arguments
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert content == "Sure.\n\nDone"  # the "\n" between the calls is markup
    # argument deltas of a call come after its start and before its end
    order = [type(e).__name__ for e in events if not isinstance(e, ContentDelta)]
    assert order[0] == "ToolCallStart" and order[-1] == "ToolCallEnd"


def test_stream_parser_holds_back_a_possible_trigger():
    parser = ToolCallStreamParser()
    assert parser.feed("hello <tool") == [ContentDelta("hello ")]
    assert parser.feed("box>") == [ContentDelta("<toolbox>")]
    assert parser.finish() == []


def test_a_tool_set_compiles_once_whatever_the_turn_or_order(toy_compiler, toy_tokenizer):
    """An agent's later turns resend its tool set (rebuilt, perhaps reordered): the grammar
    comes from the compiler's cache, and still accepts either tool's call."""
    first = grammar(toy_compiler, "auto")
    misses = toy_compiler.misses
    again = spec_from_tool_choice(tools_from_request(json.loads(json.dumps([ADD, WEATHER]))), "auto")
    assert toy_compiler.compile(again) is first
    assert toy_compiler.misses == misses
    assert accepts_text(first.matcher(), toy_tokenizer, A1) and accepts_text(first.matcher(), toy_tokenizer, W1)
    required = spec_from_tool_choice(TOOLS, "required")  # another choice is another grammar
    assert toy_compiler.compile(required) is not first
