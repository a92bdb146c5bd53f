"""Issue 24, the request-field audit (docs/CONTRACTS.md, "Request fields"): every OpenAI field
that could change the output is honoured or refused by name; the rest are accepted and change
nothing. `logit_bias` is honoured (a banned token never appears, a forced one always does);
tool results must answer a call the conversation made; `include` logprobs and `truncation`
do what they say; `tool_choice` is echoed in its normalized form."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from prescient.runtime.sampling_params import SamplingParams
from tests.server.test_http import chat, request
from tests.server.test_responses_ws import create, run, until_terminal

CHAT_REFUSED = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("reasoning_effort", "low"),
    ("verbosity", "high"),
]
RESPONSES_REFUSED = [
    ("background", True, "background"),
    ("conversation", "conv_123", "conversation"),
    ("prompt", {"id": "pmpt_123"}, "prompt"),
    ("reasoning", {"effort": "medium"}, "reasoning.effort"),
    ("reasoning", {"summary": "auto"}, "reasoning.summary"),
    ("text", {"verbosity": "low"}, "text.verbosity"),
    ("include", ["file_search_call.results", "no.such.thing"], "include[1]"),
]
# accepted: they cannot change the output (or are set to what prescient does anyway)
CHAT_NO_OPS = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "p",
               "safety_identifier": "s", "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
               "reasoning_effort": "none", "verbosity": "medium", "audio": None,
               "stream_options": {"include_usage": False, "include_obfuscation": True}, "not_an_openai_field": 1}
RESPONSES_NO_OPS = {"user": "u1", "service_tier": "default", "prompt_cache_key": "p", "safety_identifier": "s",
                    "max_tool_calls": 3, "truncation": "disabled", "background": False,
                    "include": ["reasoning.encrypted_content"], "reasoning": {"effort": None},
                    "text": {"verbosity": "medium"}, "not_an_openai_field": 1}


def respond(**fields):
    return {"model": "tiny", "input": "hi", "max_output_tokens": 2, "temperature": 0} | fields


@pytest.mark.parametrize("field, value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_a_chat_field_that_cannot_be_honoured_is_refused_by_name(tiny, field, value):
    status, got = request(tiny, "POST", "/v1/chat/completions", chat(**{field: value}))
    assert status == 400, got
    assert (got["error"]["param"], got["error"]["code"]) == (field, "unsupported_parameter")


@pytest.mark.parametrize("field, value, param", RESPONSES_REFUSED, ids=[p for _, _, p in RESPONSES_REFUSED])
def test_a_responses_field_that_cannot_be_honoured_is_refused_by_name(tiny, field, value, param):
    status, got = request(tiny, "POST", "/v1/responses", respond(**{field: value}))
    assert status == 400, got
    assert (got["error"]["param"], got["error"]["code"]) == (param, "unsupported_parameter")


def test_a_refused_field_over_the_websocket_is_an_error_event_naming_it(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(background=True))
            return await until_terminal(ws)

    (event,) = run(go())
    assert event["type"] == "error" and event["error"]["param"] == "background"
    assert event["error"]["code"] == "unsupported_parameter"


def test_fields_that_cannot_change_the_output_are_accepted(tiny):
    status, got = request(tiny, "POST", "/v1/chat/completions", chat(**CHAT_NO_OPS))
    assert status == 200, got
    status, got = request(tiny, "POST", "/v1/responses", respond(**RESPONSES_NO_OPS))
    assert status == 200 and got["status"] in ("completed", "incomplete"), got
    status, got = request(tiny, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                            "user": "u1", "echo": False, "suffix": None})
    assert status == 200, got


def _greedy(tiny, prompt_ids: list[int], n: int, **params) -> list[int]:
    return tiny.aengine.call(lambda e: e.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0,
                                                                                 ignore_eos=True, **params))[0])


def test_logit_bias_bans_and_forces_tokens(tiny):
    prompt = tiny.engine.tokenizer.encode("The weather in Oslo is")
    greedy = _greedy(tiny, prompt, 6)
    banned = sorted(set(greedy))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    status, got = request(tiny, "POST", "/v1/completions", body | {"logit_bias": {str(t): -100 for t in banned}})
    assert status == 200, got
    texts = got["choices"][0]["logprobs"]["tokens"]
    assert len(texts) == 6 and not {tiny.ctx.token_text(t) for t in banned} & set(texts), (texts, banned)

    forced = 1234
    status, got = request(tiny, "POST", "/v1/chat/completions",
                          chat(max_tokens=5, ignore_eos=True, logprobs=True, logit_bias={str(forced): 100}))
    assert status == 200, got
    tokens = [e["token"] for e in got["choices"][0]["logprobs"]["content"]]
    assert tokens == [tiny.ctx.token_text(forced)] * 5
    # ... on the Responses API too (an extension there)
    status, got = request(tiny, "POST", "/v1/responses", respond(max_output_tokens=3, logit_bias={str(forced): 100}))
    assert status == 200 and got["output"][0]["content"][0]["text"] == tiny.ctx.token_text(forced) * 3, got


def test_a_tool_result_must_answer_an_earlier_call(tiny):
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    user = {"role": "user", "content": "go"}
    for messages, ok in [([user, call, {"role": "tool", "tool_call_id": "call_1", "content": "3"}], True),
                         ([user, call, {"role": "tool", "tool_call_id": "call_2", "content": "3"}], False),
                         ([user, {"role": "tool", "tool_call_id": "call_1", "content": "3"}, call], False),
                         ([user, call, {"role": "tool", "content": "3"}], False)]:
        status, got = request(tiny, "POST", "/v1/chat/completions", chat(messages=messages))
        if ok:
            assert status == 200, got
        else:
            assert status == 400 and got["error"]["param"].endswith("].tool_call_id"), got
            assert got["error"]["param"] == f"messages[{next(i for i, m in enumerate(messages) if m['role'] == 'tool')}].tool_call_id"

    fc = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "3"}
    assert request(tiny, "POST", "/v1/responses", respond(input=[fc, out]))[0] == 200
    status, got = request(tiny, "POST", "/v1/responses", respond(input=[out | {"call_id": "c9"}]))
    assert status == 400 and (got["error"]["param"], got["error"]["code"]) == ("input[0].call_id",
                                                                               "invalid_tool_call_id"), got
    # a stored response's calls may be answered by the next turn, and only they
    first = request(tiny, "POST", "/v1/responses", respond(input=[{"role": "user", "content": "hi"}, fc, out]))[1]
    status, got = request(tiny, "POST", "/v1/responses", respond(previous_response_id=first["id"], input=[out]))
    assert status == 200, got
    status, got = request(tiny, "POST", "/v1/responses",
                          respond(previous_response_id=first["id"], input=[out | {"call_id": "c2"}]))
    assert status == 400 and got["error"]["param"] == "input[0].call_id", got


def test_include_logprobs_fills_the_response_object(tiny):
    status, got = request(tiny, "POST", "/v1/responses", respond(include=["message.output_text.logprobs"]))
    assert status == 200, got
    part = got["output"][0]["content"][0]
    assert len(part["logprobs"]) == got["usage"]["output_tokens"] and part["logprobs"][0]["top_logprobs"] == []
    status, got = request(tiny, "POST", "/v1/responses", respond(top_logprobs=2))
    assert all(len(e["top_logprobs"]) == 2 for e in got["output"][0]["content"][0]["logprobs"]), got


def test_truncation_auto_runs_what_fits_and_says_why_it_refuses_what_does_not(tiny):
    assert request(tiny, "POST", "/v1/responses", respond(truncation="auto"))[0] == 200
    status, got = request(tiny, "POST", "/v1/responses", respond(truncation="auto", input="word " * 2000))
    assert status == 400 and got["error"]["code"] == "context_length_exceeded", got
    assert "truncation 'auto'" in got["error"]["message"]
    status, got = request(tiny, "POST", "/v1/responses", respond(truncation="middle"))
    assert status == 400 and got["error"]["param"] == "truncation", got


def test_tool_choice_is_echoed_normalized(tiny):
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    choice = {"type": "function", "name": "f", "padding": "x" * 10_000}

    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(tools=[tool], tool_choice=choice, max_output_tokens=4))
            return await until_terminal(ws)

    events = run(go())
    assert events[0]["type"] == "response.created", events
    assert events[0]["response"]["tool_choice"] == {"type": "function", "name": "f"}
    assert all(len(json.dumps(e)) < 5_000 for e in events)


def test_legacy_assistant_function_call_is_rendered_as_a_tool_call(tiny):
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a": 1}'}},
                {"role": "user", "content": "and?"}]
    captured = []
    render = tiny.ctx.renderer.render

    def spy(system, msgs, **kw):
        captured.append(msgs)
        return render(system, msgs, **kw)

    tiny.ctx.renderer.render = spy
    try:
        assert request(tiny, "POST", "/v1/chat/completions", chat(messages=messages))[0] == 200
    finally:
        del tiny.ctx.renderer.render
    assert '"name": "f"' in captured[0][1]["content"] and captured[0][1]["role"] == "assistant"
