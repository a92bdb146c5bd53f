"""Tool calls streamed while several tokens arrive per step.

First `Generation` on replayed engine outputs, split into steps every way near a call's
`<tool_call>`. Then (slow) a live server over the real default model with n-gram speculation
(the default proposer) answers `tool_choice` "required" and a named function, whose grammar
forces most of each call (the header, keys, the closing markup) as spans of many tokens a step,
and "auto", where the model writes the trigger itself. On every transport (chat completions JSON
and SSE, `/v1/responses` JSON and SSE, the Responses WebSocket):
- the streamed argument deltas of each call concatenate to its final arguments, which are the
  ones the model wrote (read independently from the token texts or the stored raw output);
- no content, and no message item, carries tool-call markup or the separator between calls;
- a reply cut by `max_tokens` anywhere inside a call (the trigger `<tool_call>` split across
  steps, the header, the arguments) leaks none of it into content.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re

import openai
import pytest
import websockets

from prescient.grammar import call_header
from prescient.grammar.tools import CALL_CLOSE, CALL_SEPARATOR, CALL_TRIGGER
from prescient.runtime.request import RequestOutput
from prescient.runtime.sampling_params import SamplingParams
from prescient.server.context import ServerConfig
from prescient.server.generation import CallDelta, CallStart, Finished, Generation, TextDelta
from prescient.server.sessions import Client
from tests.conftest import sibling_engine
from tests.server.live import LiveServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                "description": "Get the current weather in a city"}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ASK = "What is the weather in Paris and in Tokyo and in Berlin?"
# "auto": the model itself writes `<tool_call>` (target tokens and n-gram drafts from the system
# prompt), then text after the call.
AUTO_ASK = "Reply with a <tool_call> for Paris."
PROMPTS = {"required": (ASK, "required"), "auto": (AUTO_ASK, "auto")}
NAMED_CHAT = {"type": "function", "function": {"name": "get_weather"}}
NAMED_RESPONSES = {"type": "function", "name": "get_weather"}
FULL = 72  # tokens: the first call and most of the second
# A call as the grammar writes it, read straight from the raw text (not by the server's parser).
CALL = re.compile(r'<tool_call>\n\{"name": "([^"]+)", "arguments": (.*?)\}\n</tool_call>', re.S)
END_OF_TURN = "<|im_end|>"  # SmolLM2's stop token, in the token texts of a reply that stopped
KEY = "sk-tool-streaming"  # no key is required; it names whose stored responses the test reads
slow = pytest.mark.slow  # the live tests: they need the real model
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def written_calls(raw: str) -> list[tuple[str, str]]:
    return CALL.findall(raw)


def text_outside_calls(raw: str, cut: bool) -> str:
    """The content a reply must have: its text between calls, less runs of whitespace alone (the
    separators); a cut reply's unwritten call, from a partial `<tool_call` on, is not text."""
    segments = CALL.sub("\0", raw.removesuffix(END_OF_TURN)).split("\0")
    if cut:
        last = segments[-1]
        at = next((i for i in range(len(last)) if last[i:].startswith(CALL_TRIGGER)
                   or CALL_TRIGGER.startswith(last[i:])), len(last))
        segments[-1] = last[:at]
    return "".join(s for s in segments if s.strip())


# ---------------------------------------------------------------- Generation on replayed steps

class Replay:
    """An engine's output queue, replayed: one RequestOutput per step, one token per character
    (its id the character's offset, carried in the logprobs)."""

    def __init__(self, steps: list[str], finish_reason: str):
        self.steps, self.finish_reason = steps, finish_reason

    def submit(self, prompt, params, request_id, session_id=None, grammar=None, arrival_time=None) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        at = 0
        for i, step in enumerate(self.steps):
            last = i == len(self.steps) - 1
            queue.put_nowait(RequestOutput(request_id, list(range(at, at + len(step))), step, last,
                                           self.finish_reason if last else None,
                                           token_times=[0.0] * len(step), token_sources=["forced"] * len(step),
                                           logprobs=[{"token_id": t, "logprob": 0.0}
                                                     for t in range(at, at + len(step))],
                                           num_prompt_tokens=1))
            at += len(step)
        return queue

    def abort(self, request_id) -> None:
        pass


def replay(steps: list[str], finish_reason: str) -> tuple[list, Generation]:
    async def go():
        gen = Generation(Replay(steps, finish_reason), [0], SamplingParams(max_tokens=1000), parse_calls=True)
        gen.start()
        return [e async for e in gen.events()], gen
    return asyncio.run(go())


REPLY = CALL_SEPARATOR.join(call_header("get_weather") + json.dumps(a) + CALL_CLOSE
                            for a in ({"city": "Paris", "unit": "celsius"}, {"city": "Tokyo", "unit": "celsius"}))


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_generation_streams_calls_exactly_however_the_steps_split_them(finish):
    second = REPLY.index(CALL_TRIGGER, 1)
    cut_at = [*range(second - 2, second + len(CALL_TRIGGER) + 3), *range(second + 16, len(REPLY), 9)]
    for stop in ([len(REPLY)] if finish == "stop" else cut_at):
        text = REPLY[:stop]
        # one step, or three: the first ends in or near the second call's trigger, the next 1 to 6 tokens on
        splits = [[text]] + [[text[:a], text[a:b], text[b:]]
                             for a in range(second - 2, min(second + len(CALL_TRIGGER) + 2, len(text)))
                             for b in range(a + 1, min(a + 7, len(text)))]
        for steps in splits:
            events, gen = replay(steps, finish)
            assert not [e for e in events if isinstance(e, TextDelta)], steps
            for start in (e for e in events if isinstance(e, CallStart)):
                args = "".join(d.text for d in events if isinstance(d, CallDelta) and d.index == start.index)
                assert args == gen.calls[start.index][1].arguments
                assert text.split(call_header(start.name))[start.index + 1].startswith(args)  # as written
            assert len(gen.complete_calls) == text.count("</tool_call>")
            # each token is reported once: with the delta it completes, or with the finish
            reported = [lp["token_id"] for e in events if isinstance(e, (TextDelta, CallDelta, Finished))
                        for lp in e.tokens.logprobs]
            assert reported == list(range(len(text)))


def test_generation_releases_held_text_that_was_not_markup():
    events, gen = replay(["Use <tool", "box> or <to"], "stop")
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Use ", "<toolbox> or ", "<to"]
    events, gen = replay(["Use <tool", "box> or <to"], "length")  # cut: the last `<to` may be a call
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Use ", "<toolbox> or "]
    assert gen.content == "Use <toolbox> or "


# ---------------------------------------------------------------- live, on the default model

@pytest.fixture(scope="module")
def server(default_engine):
    # calibrate="off": the default verify-cost table, so drafting does not change mid-module; no
    # ITL time budget: it sizes the draft slots from the measured step time, and on a loaded host
    # it leaves drafts none, so no chunk would carry several tokens (check_*: `> 1`)
    engine = sibling_engine(default_engine, speculate="ngram", calibrate="off",
                            scheduler=dataclasses.replace(default_engine.config.scheduler, itl_target_s=None))
    server = LiveServer(engine, ServerConfig())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, max_tokens: int, mode: str = "required", tool_choice=None, **extra):
    prompt, choice = PROMPTS[mode]
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          tools=CHAT_TOOLS, tool_choice=tool_choice or choice,
                                          max_tokens=max_tokens, temperature=0, logprobs=True, **extra)


def stream(client, max_tokens: int, mode: str = "required", tool_choice=None) -> list:
    return list(chat(client, max_tokens, mode, tool_choice, stream=True, stream_options={"include_usage": True}))


@pytest.fixture(scope="module")
def cuts(client) -> dict[str, dict]:
    """Per mode, max_tokens values that end the reply at chosen places, found in the token texts
    of a longer reply."""
    out = {}
    for mode in PROMPTS:
        tokens = [t.token for t in chat(client, FULL, mode).choices[0].logprobs.content]
        text, ends = "".join(tokens), list(itertools.accumulate(map(len, tokens)))
        starts = [m.start() for m in re.finditer(re.escape(CALL_TRIGGER), text)]
        assert starts and written_calls(text), text

        def ending_in(lo: int, hi: int) -> list[int]:  # every k whose k tokens end the text in [lo, hi]
            return [k + 1 for k, end in enumerate(ends) if lo <= end <= hi]

        header = len(call_header("get_weather"))
        # the first call's `<`, `<tool`, ... `<tool_call>`, then every third token of its header
        points = {"first header": ending_in(1, len(CALL_TRIGGER)) +
                  ending_in(len(CALL_TRIGGER) + 1, starts[0] + header + 1)[::3]}
        if mode == "required":  # call after call
            at = starts[1]
            first_close = text.index("</tool_call>") + len("</tool_call>")
            points |= {"first call": ending_in(first_close, first_close)[0],
                       "separator": ending_in(at, at)[0],
                       "trigger": ending_in(at + 1, at + len(CALL_TRIGGER) - 1)[0],  # a partial `<tool_call>`
                       "header": ending_in(at + len(CALL_TRIGGER), at + header - 1)[-1],
                       "arguments": ending_in(at + header + 2, at + header + 14)[0],
                       "second trigger": ending_in(at, at + len(CALL_TRIGGER))}
        else:  # a call, then text
            points["text"] = ending_in(text.index("</tool_call>") + len("</tool_call>") + 3, len(text))[0]
        out[mode] = points
    return out


# ---------------------------------------------------------------- chat completions

def check_chat_message(choice, cut: bool) -> None:
    raw = "".join(t.token for t in choice.logprobs.content)
    assert (choice.message.content or "") == text_outside_calls(raw, cut), raw  # no markup, no separator
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == written_calls(raw)
    assert choice.finish_reason == ("length" if cut else "tool_calls")


def check_chat_stream(chunks, cut: bool) -> None:
    choices = [c.choices[0] for c in chunks if c.choices]
    raw = "".join(t.token for ch in choices if ch.logprobs for t in ch.logprobs.content)
    assert "".join(ch.delta.content or "" for ch in choices) == text_outside_calls(raw, cut), raw
    calls: dict[int, list[str]] = {}
    for ch in choices:
        for tc in ch.delta.tool_calls or []:
            if tc.function.name:
                assert tc.index not in calls  # a call starts once
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    streamed = [tuple(calls[i]) for i in sorted(calls)]
    written = written_calls(raw)
    assert streamed[:len(written)] == written, raw
    assert len(streamed) - len(written) in ((0, 1) if cut else (0,))
    if len(streamed) > len(written):  # the call being written when max_tokens cut the reply
        name, args = streamed[-1]
        assert raw[raw.rindex(call_header(name)) + len(call_header(name)):].startswith(args)
    assert choices[-1].finish_reason == ("length" if cut else "tool_calls")
    # every token reported once, and some chunks carried several (forced spans, accepted drafts)
    timed = [c for c in chunks if getattr(c, "token_times", None)]
    assert sum(len(c.token_times) for c in timed) == chunks[-1].usage.completion_tokens
    assert max(len(c.token_times) for c in timed if c.choices and c.choices[0].delta.tool_calls) > 1


@slow
@pytest.mark.parametrize("mode", ["required", "auto"])
def test_chat_reply_cut_inside_a_call_leaks_no_markup(client, cuts, mode):
    for k in cuts[mode]["first header"] + cuts[mode].get("second trigger", []):
        check_chat_message(chat(client, k, mode).choices[0], cut=True)


@slow
@pytest.mark.parametrize("where", ["first call", "separator", "trigger", "header", "arguments"])
def test_chat_stream_arguments_concatenate_to_the_written_calls(client, cuts, where):
    check_chat_stream(stream(client, cuts["required"][where]), cut=True)


@slow
def test_chat_auto_call_then_text(client, cuts):
    k = cuts["auto"]["text"]
    message = chat(client, k, "auto").choices[0]
    check_chat_message(message, cut=True)
    assert message.message.tool_calls and message.message.content.strip()
    check_chat_stream(stream(client, k, "auto"), cut=True)


@slow
def test_chat_named_call_streamed_and_not(client):
    check_chat_message(chat(client, 60, tool_choice=NAMED_CHAT).choices[0], cut=False)
    check_chat_stream(stream(client, 60, tool_choice=NAMED_CHAT), cut=False)


# ---------------------------------------------------------------- Responses: HTTP and WebSocket

def stored_output(server, response_id: str) -> str:
    """The model's raw output, as the server keeps it for previous_response_id."""
    return server.ctx.store.get(response_id, Client.of({"authorization": f"Bearer {KEY}"})).messages[-1]["content"]


def check_response(final: dict, raw: str, cut: bool) -> None:
    assert final["status"] == ("incomplete" if cut else "completed")
    assert [i["type"] for i in final["output"]] == ["function_call"] * len(final["output"]), raw  # no message
    done = [(i["name"], i["arguments"]) for i in final["output"] if i["status"] == "completed"]
    assert done == written_calls(raw)
    rest = final["output"][len(done):]
    assert len(rest) <= (1 if cut else 0) and all(i["status"] == "incomplete" for i in rest)
    for item in rest:  # cut inside its arguments: what was streamed is what the model wrote
        header = call_header(item["name"])
        assert raw[raw.rindex(header) + len(header):].startswith(item["arguments"])


def check_response_events(events: list[dict], raw: str, cut: bool) -> None:
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.incomplete" if cut else "response.completed")
    assert not [e for e in events if e["type"].startswith(("response.output_text", "response.content_part"))]
    check_response(final, raw, cut)
    for item in final["output"]:
        deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["item_id"] == item["id"]]
        assert "".join(e["delta"] for e in deltas) == item["arguments"]
        (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"
                   and e["item_id"] == item["id"]]
        assert done["arguments"] == item["arguments"]
    timed = [e for e in events if "num_tokens" in e]
    assert sum(e["num_tokens"] for e in timed) == final["usage"]["output_tokens"]
    assert max(e["num_tokens"] for e in timed if e["type"] == "response.function_call_arguments.delta") > 1


def responses_args(max_tokens: int, tool_choice) -> dict:
    return dict(model="default", input=ASK, tools=RESPONSES_TOOLS, tool_choice=tool_choice,
                max_output_tokens=max_tokens, temperature=0)


def websocket_events(server, max_tokens: int, tool_choice) -> list[dict]:
    async def go() -> list[dict]:
        async with websockets.connect(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.send(json.dumps({"type": "response.create", **responses_args(max_tokens, tool_choice)}))
            events = []
            while not events or events[-1]["type"] not in TERMINAL:
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            return events

    return asyncio.run(go())


@slow
@pytest.mark.parametrize("where", ["trigger", "header", "arguments", "named"])
def test_responses_stream_over_http_and_websocket(server, client, cuts, where):
    cut = where != "named"
    max_tokens, choice = (cuts["required"][where], "required") if cut else (60, NAMED_RESPONSES)
    sse = [e.model_dump() for e in client.responses.create(**responses_args(max_tokens, choice), stream=True)]
    check_response_events(sse, stored_output(server, sse[-1]["response"]["id"]), cut)
    ws = websocket_events(server, max_tokens, choice)
    check_response_events(ws, stored_output(server, ws[-1]["response"]["id"]), cut)
    whole = client.responses.create(**responses_args(max_tokens, choice)).model_dump()
    check_response(whole, stored_output(server, whole["id"]), cut)
