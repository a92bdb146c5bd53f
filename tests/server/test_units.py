"""The server's pure parts, without a server: error naming, the bounded outbox, the response
store, conversation rendering (both APIs, tools, the token-exact prefix), output budgets."""

from __future__ import annotations

import asyncio
import json

import pytest

from prescient.server.chat import ChatRenderer, Rendered, messages_from_chat, messages_from_items, split_system
from prescient.server.errors import APIError
from prescient.server.generation import check_max_tokens
from prescient.server.protocol import ChatCompletionRequest, ClientEvent, ResponseCreateParams, decode
from prescient.server.responses_ws import Outbox
from prescient.server.sessions import Conversation, ResponseStore
from prescient.server.tools import FunctionTool, render_tool_call, tool_setup, tools_system_text


@pytest.mark.parametrize("body,param", [
    (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [], "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
    (b'{"model": "m", "messages": [], "top_p": 0}', "top_p"),
    (b'{"model": "m", "messages": [], "stop": [1]}', "stop[0]"),
])
def test_decode_errors_name_the_field(body, param):
    with pytest.raises(APIError) as err:
        decode(body, ChatCompletionRequest)
    assert err.value.status == 400 and err.value.param == param
    assert param.split("[")[0].split(".")[-1] in err.value.message


def test_client_events_decode_by_type():
    event = decode(b'{"type": "response.create", "input": "hi", "max_output_tokens": 3, "stream_id": "a"}',
                   ClientEvent)
    assert isinstance(event, ResponseCreateParams) and event.max_output_tokens == 3 and event.stream_id == "a"
    with pytest.raises(APIError) as err:
        decode(b'{"type": "response.steer"}', ClientEvent)
    assert err.value.param == "type"


def test_outbox_is_bounded_in_bytes():
    async def go():
        box = Outbox(limit_bytes=10)
        assert box.put("x" * 20)  # one oversized event still goes through an empty box
        assert not box.put("y")
        assert await box.get() == "x" * 20
        assert box.put("a" * 6) and not box.put("b" * 6) and box.put("c" * 4)
        assert box.put("overflow", force=True) and not box.put("x" * 3, force=True)  # forced: up to 2x
        return [await box.get() for _ in range(3)], len(box)

    assert asyncio.run(go()) == (["a" * 6, "c" * 4, "overflow"], 0)


def test_response_store_expires_and_evicts():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    conv = lambda rid: Conversation(rid, "s", (), Rendered("", ()))  # noqa: E731
    store.put(conv("a"))
    store.put(conv("b"))
    assert store.get("a").response_id == "a"  # touching "a" makes "b" the eldest
    store.put(conv("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    now[0] = 11
    assert store.get("a") is None and store.get("c") is None


def test_response_store_is_bounded_in_bytes_and_keeps_the_newest():
    store = ResponseStore(max_entries=100, ttl_s=10, max_bytes=20_000)
    ids = tuple(range(1000, 2000))  # 1000 tokens: ~4 KB as int32 (a tuple of ints would be ~36 KB)
    conv = lambda rid, n=1000: Conversation(rid, "s", ({"role": "user", "content": "hi"},),  # noqa: E731
                                            Rendered("x" * n, ids[:n]))
    for i in range(10):
        store.put(conv(f"r{i}"))
    assert store.nbytes <= 20_000 and 2 <= len(store) < 10
    assert store.get("r9").rendered == Rendered("x" * 1000, ids)  # the newest, intact
    assert store.get("r0") is None  # the eldest went first
    store.put(Conversation("huge", "s", (), Rendered("y" * 50_000, ())))
    assert len(store) == 1 and store.get("huge") is not None  # alone over the bound, but kept
    store.put(conv("after"))
    assert store.get("huge") is None and store.nbytes == sum(e.nbytes for e in store._entries.values())


def test_both_apis_render_tool_turns_the_same():
    chat = decode(json.dumps({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:00"}]}), ChatCompletionRequest).messages
    items = decode(json.dumps({"input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "14:00"}]}), ResponseCreateParams).input
    plain = messages_from_chat(chat)
    assert plain == messages_from_items(items)
    system, rest = split_system(plain)
    assert system == ["Be brief."] and [m["role"] for m in rest] == ["user", "assistant", "user"]
    assert rest[1]["content"] == (render_tool_call("get_weather", '{"city": "Oslo"}') + "\n" +
                                  render_tool_call("get_time", "not json"))
    assert '{"name": "get_time", "arguments": "not json"}' in rest[1]["content"]  # kept well-formed
    assert rest[2]["content"] == "<tool_response>\n3 C\n</tool_response>\n<tool_response>\n14:00\n</tool_response>"


def test_tools_system_text_is_the_documented_hermes_block():
    tools = (FunctionTool("get_weather", "Current weather", {"type": "object"}), FunctionTool("noop", None, None))
    text = tools_system_text(tools)
    body = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line)["function"]["name"] for line in body.splitlines()] == ["get_weather", "noop"]
    assert text.startswith("# Tools") and "<tool_call>\n" in text
    setup = tool_setup(list(tools), "none", None)
    assert setup.grammar is None and not setup.parse_calls and setup.system_text() == text
    with pytest.raises(APIError) as err:
        tool_setup(list(tools), {"type": "function", "name": "missing"}, None)
    assert err.value.param == "tool_choice"


@pytest.fixture(scope="module")
def renderer(smol_tokenizer_dir):
    from prescient.runtime.tokenizer import Tokenizer

    return ChatRenderer(Tokenizer.load(str(smol_tokenizer_dir)))


def test_next_turn_extends_the_previous_turn_token_for_token(renderer):
    tok = renderer.tokenizer
    history = [{"role": "user", "content": "Hi there"}]
    turn1 = renderer.render(["You help."], history)
    # An output the tokenizer would split differently if it re-tokenized the text.
    output = tok.encode(" hel") + tok.encode("lo wor") + tok.encode("ld") + [tok.eos_token_ids[0]]
    ids, text = renderer.model_output(output)
    assert ids == output[:-1] and text == " hello world"
    previous = Rendered(turn1.text + text, turn1.token_ids + tuple(ids))
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And now?"}]
    turn2 = renderer.render(["You help."], history, prefix=previous)
    assert turn2.token_ids[:len(previous.token_ids)] == previous.token_ids
    assert tok.decode(list(turn2.token_ids), skip_special_tokens=False) == turn2.text
    # A different system prompt changes the text before the old output: tokenized anew.
    other = renderer.render(["You help a lot."], history, prefix=previous)
    assert other.token_ids == tuple(tok.encode(other.text))


def test_output_budget():
    assert check_max_tokens(10, None, 1024, 100, "max_tokens") == 90
    assert check_max_tokens(10, 50, 1024, 100, "max_tokens") == 50
    with pytest.raises(APIError) as err:
        check_max_tokens(10, 91, 1024, 100, "max_output_tokens")
    assert err.value.param == "max_output_tokens" and err.value.code == "context_length_exceeded"
    with pytest.raises(APIError):
        check_max_tokens(100, None, 1024, 100, "max_tokens")
