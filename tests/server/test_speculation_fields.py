"""Per-request speculation through the server (tiny model): `"speculate": false` decodes without
drafts, `"slo": {"itl_ms": ...}` reaches the planner, bad values are 400s naming the field, and a
tenant's later requests draft from its earlier outputs (the shared pool) with sources that say
only `draft`, the same output, and nothing shared when `--no-shared-pool`."""

from __future__ import annotations

import hashlib
import http.client
import json

import pytest

from prescient.server.protocol import ChatCompletionRequest, decode
from prescient.server.sessions import Client

SOURCES = {"target", "draft", "forced"}


def stream_chat(server, **overrides) -> tuple[str, list[str]]:
    """(text, token_sources) of a streamed greedy chat completion."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Repeat after me: the quick brown fox"}],
            "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True, **overrides}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    text, sources = "", []
    for line in resp.read().decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
        sources += chunk.get("token_sources") or []
    conn.close()
    return text, sources


def post(server, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def ngram_server(model_dir, **config):
    """A tiny n-gram server whose verify-cost table and draft cost are fixed (measured ones, on a
    loaded machine, could switch drafting off and make the draft counts below depend on the load)."""
    from prescient.build import EngineSpec, build_engine
    from prescient.runtime.config import CacheConfig
    from prescient.runtime.engine import EngineConfig
    from prescient.server.context import ServerConfig
    from tests.server.live import LiveServer

    spec = EngineSpec(model=str(model_dir), dtype="float64", speculate="ngram", calibrate="off", progress=False)
    engine = build_engine(spec, config=EngineConfig(dtype="float64", cache=CacheConfig(num_blocks=512)))
    engine.speculator.adaptive.set_verify_cost({1: 1.0, 8: 1.05, 16: 1.1})
    # and its draft cost frozen at 0 (an n-gram lookup's price): measured, it is the proposal's
    # time over a timed forward's, 0 until the first forward is timed and then whatever the load
    # made of it, so two identical requests could get different draft budgets
    engine.speculator.adaptive.set_draft_cost(0.0)
    engine.speculator.adaptive.set_draft_cost = lambda cost: None
    return LiveServer(engine, ServerConfig(model_name="tiny", **config))


@pytest.fixture(scope="module")
def pooled(tiny_model_dir):
    server = ngram_server(tiny_model_dir)
    yield server
    server.stop()


def test_speculate_false_decodes_without_drafts(pooled):
    text, sources = stream_chat(pooled, speculate=False)
    again, _ = stream_chat(pooled)
    assert sources and set(sources) == {"target"}
    assert text == again


def test_a_tenants_later_request_drafts_from_its_earlier_output(pooled, tiny_model_dir):
    prompt = [{"role": "user", "content": "Write down a list of seven colours"}]
    first_text, first = stream_chat(pooled, messages=prompt)
    second_text, second = stream_chat(pooled, messages=prompt)
    assert second_text == first_text  # the pool only proposes
    assert set(first) <= SOURCES and set(second) <= SOURCES  # nothing tells where a draft came from
    assert second.count("draft") > first.count("draft")
    assert second.count("draft") >= len(second) // 2

    alone = ngram_server(tiny_model_dir, shared_pool=False)
    try:
        alone_first_text, alone_first = stream_chat(alone, messages=prompt)
        alone_second_text, alone_second = stream_chat(alone, messages=prompt)
    finally:
        alone.stop()
    assert alone_first_text == alone_second_text == first_text
    assert alone_second.count("draft") == alone_first.count("draft")  # nothing learned across requests


@pytest.mark.parametrize("overrides, param, named", [
    ({"speculate": "no"}, "speculate", "bool"),
    ({"slo": {"itl_ms": 0}}, "slo.itl_ms", "> 0"),
    ({"slo": {"itl_ms": "fast"}}, "slo.itl_ms", "float"),
    ({"slo": {"ttft": 5}}, "slo", "ttft"),  # a bound it cannot honor is not silently dropped
    ({"slo": 50}, "slo", "object"),
])
def test_bad_per_request_options_are_refused_by_name(pooled, overrides, param, named):
    status, body = post(pooled, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                 **overrides})
    assert status == 400
    assert body["error"]["param"] == param and named in body["error"]["message"]
    assert stream_chat(pooled, max_tokens=2)[1]  # and the server goes on serving


def _fields(**body) -> ChatCompletionRequest:
    return decode(json.dumps({"model": "tiny", "messages": [], **body}), ChatCompletionRequest)


def test_options_and_tenant_reach_the_sampling_params(pooled, make_tiny_server):
    ctx = pooled.ctx
    params = ctx.sampling(_fields(slo={"itl_ms": 40}, speculate=False), 8)
    assert params.max_itl_s == pytest.approx(0.040) and params.speculate is False
    default = ctx.sampling(_fields(), 8)
    assert default.max_itl_s is None and default.speculate is True
    # no --api-key: every client is one tenant, whatever bearer token it sends
    assert default.tenant == "" == ctx.tenant(Client.of({"authorization": "Bearer someone"}))
    keyed = make_tiny_server(api_key="k1").ctx
    digest = hashlib.sha256(b"k1").hexdigest()
    assert keyed.tenant(Client.of({"authorization": "Bearer k1"})) == digest == keyed.sampling(_fields(), 8).tenant
    assert digest != "k1"  # the raw key is not what the engine keeps
    assert make_tiny_server(shared_pool=False).ctx.sampling(_fields(), 8).tenant is None


def test_responses_take_the_same_options(pooled):
    conn = http.client.HTTPConnection("127.0.0.1", pooled.port, timeout=60)
    for body, status in (({"slo": {"itl_ms": -5}}, 400), ({"speculate": False, "slo": {"itl_ms": 50}}, 200)):
        conn.request("POST", "/v1/responses", body=json.dumps({"input": "hi", "max_output_tokens": 3, **body}),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert resp.status == status, answer
        if status == 400:
            assert answer["error"]["param"] == "slo.itl_ms"
        else:
            assert answer["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens reached
    conn.close()
