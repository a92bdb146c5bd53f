"""The Responses WebSocket protocol on the tiny model, driven with the raw `websockets` client:
event order and sequence numbers, timing fields, cancel, disconnect, 32 concurrent sockets,
sessions, warm-up, slow readers, and an `error` event for every kind of bad frame."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest
import websockets

from prescient.runtime.sampling_params import SamplingParams
from tests.server.conftest import TINY_CONTEXT
from tests.server.test_http import request

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def create(**fields) -> str:
    event = {"type": "response.create", "model": "tiny", "input": "Hello there", "max_output_tokens": 8,
             "temperature": 0}
    event.update(fields)
    return json.dumps({k: v for k, v in event.items() if v is not None})


async def until_terminal(ws, timeout: float = 30.0) -> list[dict]:
    events = []
    while True:
        events.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
        if events[-1]["type"] in TERMINAL:
            return events


def run(coro):
    return asyncio.run(coro)


def deltas(events, kind="response.output_text.delta"):
    return [e for e in events if e["type"] == kind]


def test_event_sequence_and_timing(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(max_output_tokens=8))
            return await until_terminal(ws)

    events = run(go())
    types = [e["type"] for e in events]
    n = len(deltas(events))
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n +
                     ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                      "response.incomplete"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["id"] == events[0]["response"]["id"] and events[0]["response"]["status"] == "in_progress"
    text = "".join(e["delta"] for e in deltas(events))
    assert events[-4]["text"] == text and final["output"][0]["content"][0]["text"] == text
    assert final["output"][0]["status"] == "incomplete"
    # Every token is reported exactly once, with its time and source.
    reported = deltas(events) + [events[-1]]
    assert sum(e["num_tokens"] for e in reported) == final["usage"]["output_tokens"] == 8
    times = [t for e in reported for t in e["token_times"]]
    assert times == sorted(times) and len(times) == 8 and events[-1]["ttft_s"] == pytest.approx(times[0])
    assert {s for e in reported for s in e["token_sources"]} <= {"target", "draft", "forced"}
    assert all(len(e["token_times"]) == e["num_tokens"] == len(e["token_sources"]) for e in reported)


def test_sequence_numbers_increase_across_responses_and_stream_id_is_echoed(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(max_output_tokens=2, stream_id="lane-a"))
            first = await until_terminal(ws)
            await ws.send(create(max_output_tokens=2))
            return first, await until_terminal(ws)

    first, second = run(go())
    seqs = [e["sequence_number"] for e in first + second]
    assert seqs == list(range(len(seqs)))
    assert {e["stream_id"] for e in first} == {"lane-a"} and {e["stream_id"] for e in second} == {None}


def test_cancel_mid_stream_stops_within_a_step_and_frees_kv(tiny, monkeypatch):
    baseline = tiny.wait_until(lambda s: s["requests"] == 0)
    # Each step made at least 30 ms long (the tiny model takes 3-5 ms, so at its own pace a cancel
    # round trip delayed 150 ms by a loaded host let 40 tokens through): the bound below then
    # allows over a second for the cancel to reach the engine, and still catches a cancel that
    # does not stop the generation (900 tokens). Undone after the test (the server is shared).
    step = tiny.engine.step

    def slow_step():
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(tiny.engine, "step", slow_step)

    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(max_output_tokens=900, input="Tell me a long story"))
            events = []
            while len(deltas(events)) < 3:
                events.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "response.cancel"}))
            events += await until_terminal(ws)
            return events

    events = run(go())
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "cancelled"
    assert final["response"]["incomplete_details"]["reason"] == "cancelled"
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
    # Generation stopped within a few steps of the cancel (tokens already in flight still arrive):
    # 3 tokens were read before it; 40 is ~35 more slowed steps.
    output_tokens = final["response"]["usage"]["output_tokens"]
    assert sum(e["num_tokens"] for e in deltas(events)) <= output_tokens < 40
    state = tiny.wait_until(lambda s: s["requests"] == 0 and s["free"] == baseline["free"], timeout=2)
    assert state["requests"] == 0 and state["free"] == baseline["free"]


def test_cancel_by_id_and_cancel_of_nothing(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(json.dumps({"type": "response.cancel"}))
            nothing = json.loads(await ws.recv())
            await ws.send(create(max_output_tokens=900))
            created = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "response.cancel", "response_id": "resp_other"}))
            await ws.send(json.dumps({"type": "response.cancel", "response_id": created["response"]["id"]}))
            return nothing, await until_terminal(ws), await until_terminal(ws)

    nothing, wrong, cancelled = run(go())
    assert nothing["type"] == "error" and nothing["error"]["code"] == "response_not_found"
    assert wrong[-1]["type"] == "error" and wrong[-1]["error"]["code"] == "response_not_found"
    assert cancelled[-1]["response"]["status"] == "cancelled"


def test_disconnect_mid_stream_frees_kv(tiny):
    baseline = tiny.wait_until(lambda s: s["requests"] == 0)

    async def go():
        ws = await websockets.connect(tiny.ws_url)
        await ws.send(create(max_output_tokens=900))
        got = 0
        while got < 3:
            got += json.loads(await ws.recv())["type"] == "response.output_text.delta"
        assert tiny.engine_state()["requests"] == 1
        ws.transport.abort()  # vanish without a close handshake

    run(go())
    state = tiny.wait_until(lambda s: s["requests"] == 0 and s["free"] == baseline["free"], timeout=2)
    assert state["requests"] == 0 and state["free"] == baseline["free"]


def test_32_concurrent_sockets_each_get_exactly_their_own_tokens(tiny):
    prompts = [f"Request number {i}: describe the color {i * 7 % 13} of item {i}" for i in range(32)]
    max_tokens = 12
    ids = [tiny.ctx.renderer.render([], [{"role": "user", "content": p}]).token_ids for p in prompts]

    def reference(engine):  # the same prompts through the engine alone, as one batch
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        rids = [engine.add_request(list(p), params, request_id=f"ref-{i}").request_id for i, p in enumerate(ids)]
        text = dict.fromkeys(rids, "")
        while engine.has_unfinished_requests():
            for out in engine.step():
                text[out.request_id] += out.new_text
        return [text[r] for r in rids]

    expected = tiny.aengine.call(reference)
    assert len(set(expected)) > 16  # distinct streams, so a mix-up would show

    async def one(i):
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(input=prompts[i], max_output_tokens=max_tokens))
            return await until_terminal(ws, timeout=120)

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = run(all_of_them())
    for i, events in enumerate(results):
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "".join(e["delta"] for e in deltas(events)) == expected[i], f"socket {i}"
        reported = deltas(events) + [events[-1]]
        assert sum(e["num_tokens"] for e in reported) == max_tokens
        times = [t for e in reported for t in e["token_times"]]
        assert times == sorted(times)


def test_previous_response_id_reuses_the_conversation_prefix(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(instructions="You are terse.", input="First question, about apples?",
                                 max_output_tokens=20))
            turn1 = await until_terminal(ws)
            rid = turn1[-1]["response"]["id"]
            await ws.send(create(instructions="You are terse.", input="And pears?", previous_response_id=rid,
                                 max_output_tokens=4))
            turn2 = await until_terminal(ws)
            await ws.send(create(input="Again", previous_response_id=turn2[-1]["response"]["id"],
                                 max_output_tokens=2))
            turn3 = await until_terminal(ws)
            return turn1[-1]["response"], turn2[-1]["response"], turn3[-1]["response"]

    r1, r2, r3 = run(go())
    u1, u2 = r1["usage"], r2["usage"]
    assert r2["previous_response_id"] == r1["id"]
    # Turn 2's prompt is turn 1's prompt + output + the new message; all but the last partial
    # block of what turn 1 saw is served from the cache.
    history = u1["input_tokens"] + u1["output_tokens"]
    assert u2["input_tokens"] > history
    assert u2["input_tokens_details"]["cached_tokens"] >= history - 16
    # Turn 3 drops the instructions: the system prompt changes, so the history is rendered anew
    # (and still accepted).
    assert r3["status"] == "incomplete" and r3["usage"]["input_tokens"] > 0


def test_generate_false_warms_the_session(tiny):
    tools = [{"type": "function", "name": "lookup", "description": "Look a word up",
              "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}]

    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            await ws.send(create(instructions="Use tools.", tools=tools, input="I will ask about words.",
                                 generate=False))
            warm = await until_terminal(ws)
            await ws.send(create(instructions="Use tools.", tools=tools, tool_choice="none", input="What is a fjord?",
                                 previous_response_id=warm[-1]["response"]["id"], max_output_tokens=2))
            return warm, await until_terminal(ws)

    warm, turn = run(go())
    assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
    w = warm[-1]["response"]
    assert w["output"] == [] and w["usage"]["output_tokens"] == 0
    assert turn[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= w["usage"]["input_tokens"] - 16


def test_several_responses_in_flight_on_one_connection(make_tiny_server):
    server = make_tiny_server(max_responses_per_connection=2)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            for i in range(3):
                await ws.send(create(input=f"stream {i}", max_output_tokens=6, stream_id=f"s{i}"))
            events = []
            while sum(e["type"] in TERMINAL for e in events) < 3:
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return events

    events = run(go())
    refused = [e for e in events if e["type"] == "error"]
    assert len(refused) == 1 and refused[0]["error"]["code"] == "too_many_responses"
    assert refused[0]["stream_id"] == "s2" and refused[0]["status"] == 429
    done = {e["stream_id"]: e for e in events if e["type"] == "response.incomplete"}
    assert set(done) == {"s0", "s1"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for lane in ("s0", "s1"):
        lane_text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"
                            and e["stream_id"] == lane)
        assert done[lane]["response"]["output"][0]["content"][0]["text"] == lane_text


BAD_FRAMES = [
    # (frame, status, param, code)
    ("{not json", 400, None, "invalid_json"),
    ("[1, 2]", 400, None, "invalid_type"),
    (json.dumps({"type": "session.update"}), 400, "type", "unknown_event_type"),
    (json.dumps({"input": "hi"}), 400, "type", None),
    (create(temperature="hot"), 400, "temperature", "invalid_type"),
    (create(max_output_tokens=0), 400, "max_output_tokens", None),
    (create(input=[{"role": "user", "content": [{"type": "input_image"}]}]), 400, "input[0].content[0].type",
     "unsupported_content"),
    (create(input=[{"type": "reasoning"}]), 400, "input[0].type", "unsupported_item"),
    (create(model="gpt-5"), 404, "model", "model_not_found"),
    (create(previous_response_id="resp_gone"), 400, "previous_response_id", "previous_response_not_found"),
    (create(text={"format": {"type": "json_schema", "name": "x",
                             "schema": {"$ref": "https://example.com/another.json"}}}),
     400, "text.format", "invalid_grammar"),
    (create(tools=[{"type": "web_search"}]), 400, "tools[0].type", "unsupported_tool"),
    (create(input="word " * (TINY_CONTEXT + 10)), 400, "input", "context_length_exceeded"),
    (create(max_output_tokens=TINY_CONTEXT), 400, "max_output_tokens", "context_length_exceeded"),
]


def test_every_bad_frame_gets_an_error_event_and_the_connection_lives_on(tiny):
    async def go():
        async with websockets.connect(tiny.ws_url) as ws:
            answers = []
            for frame, *_ in BAD_FRAMES:
                await ws.send(frame)
                answers.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            await ws.send(b'{"type": "response.create", "model": "default", "input": "ok", "max_output_tokens": 2}')
            return answers, await until_terminal(ws)

    answers, good = run(go())
    for (frame, status, param, code), ev in zip(BAD_FRAMES, answers):
        assert ev["type"] == "error", frame
        assert ev["status"] == status and ev["error"]["param"] == param and ev["error"]["message"], (frame, ev)
        if code is not None:
            assert ev["error"]["code"] == code, (frame, ev)
    assert good[-1]["type"] == "response.incomplete"


def test_oversized_frames(make_tiny_server):
    server = make_tiny_server(max_frame_bytes=1024)

    async def go():
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.send(create(input="x" * 2000))
            too_big = json.loads(await ws.recv())
            await ws.send(create(max_output_tokens=2))
            ok = await until_terminal(ws)
        async with websockets.connect(server.ws_url) as ws:  # past the hard cap: closed with 1009
            await ws.send("x" * ((1 << 20) + 1))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        return too_big, ok, closed.value.rcvd.code

    too_big, ok, code = run(go())
    assert too_big["type"] == "error" and too_big["error"]["code"] == "frame_too_large" and too_big["status"] == 413
    assert ok[-1]["type"] == "response.incomplete"
    assert code == 1009


def test_slow_reader_overflows_its_own_buffer_not_the_engine(make_tiny_server):
    # Small socket buffers on both ends and fat events (20 logprobs a token), so the outbox
    # fills after a few hundred tokens instead of megabytes of kernel buffering.
    server = make_tiny_server(ws_buffer_bytes=16 << 10, send_buffer=4096)
    baseline = server.wait_until(lambda s: s["requests"] == 0)

    async def go():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that barely reads
        sock.connect(("127.0.0.1", server.port))
        slow = await websockets.connect(server.ws_url, sock=sock, max_queue=1)
        await slow.send(create(input="flood", max_output_tokens=900, store=False, top_logprobs=20))
        async with websockets.connect(server.ws_url) as fast:  # others keep streaming meanwhile
            await fast.send(create(max_output_tokens=4, store=False))
            other = await until_terminal(fast, timeout=30)
        state = server.wait_until(lambda s: s["requests"] == 0, timeout=60)
        events = []
        async for message in slow:  # now read everything that was buffered
            events.append(json.loads(message))
            if events[-1]["type"] in TERMINAL:
                break
        await slow.close()
        return other, state, events

    other, state, events = run(go())
    assert other[-1]["type"] == "response.incomplete"
    assert state["requests"] == 0 and state["free"] == baseline["free"]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "slow_consumer"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # nothing lost in between
    assert len(deltas(events)) < 600


def test_the_sdk_connection_cancels_and_parses_errors(tiny):
    import openai

    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0)
    with client.responses.connect() as conn:
        conn.response.create(model="tiny", input="Go on and on", max_output_tokens=900, temperature=0)
        seen = 0
        for event in conn:
            if event.type == "response.output_text.delta":
                assert event.num_tokens == len(event.token_times) >= 1  # extension fields survive the SDK
                seen += 1
                if seen == 3:
                    conn.send({"type": "response.cancel"})
            if event.type in TERMINAL:
                break
        assert event.type == "response.incomplete" and event.response.status == "cancelled"
        conn.send({"type": "response.steer", "input": "faster", "previous_response_id": event.response.id})
        error = conn.recv()
        assert error.type == "error" and error.error.code == "unknown_event_type" and error.error.param == "type"


def test_a_client_that_floods_frames_and_never_reads_is_dropped(make_tiny_server):
    server = make_tiny_server(ws_buffer_bytes=4096, send_buffer=4096)

    async def go():
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        flood = await websockets.connect(server.ws_url, sock=sock, max_queue=1)
        with contextlib.suppress(websockets.ConnectionClosed, asyncio.TimeoutError):
            for _ in range(5000):  # each bad frame earns an ~250-byte error event nobody reads
                await asyncio.wait_for(flood.send("not json"), 2)
        # The server has stopped reading this client and released its connection; the client's
        # socket stays half-open (unsent events pending) until it goes away.
        metrics = (await asyncio.to_thread(request, server, "GET", "/metrics"))[1].decode()
        async with websockets.connect(server.ws_url) as ws:  # everyone else is still served
            await ws.send(create(max_output_tokens=2))
            events = await until_terminal(ws)
        flood.transport.abort()
        return metrics, events

    metrics, events = run(go())
    assert "prescient_open_connections 1.0" in metrics  # only this /metrics request is open
    assert events[-1]["type"] == "response.incomplete"
