"""The agent loop end to end against a live prescient server (the default model behind the real
HTTP and WebSocket APIs, in a thread), and the report it feeds."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from prescient.latency_bench.agent_bench import AgentBenchConfig
from prescient.latency_bench.agent_http import ChatHTTPTransport
from prescient.latency_bench.agent_report import build_report, write_report
from prescient.latency_bench.agent_tasks import AgentTask, CallRecord, TaskRecord, load_tasks, load_toolsets
from prescient.latency_bench.agent_ws import ResponsesWSTransport
from prescient.latency_bench.bench_servers import _tree_cpu_s
from prescient.latency_bench.tool_agents import closed_loop, run_task
from prescient.runtime.slo import RequestTrace
from prescient.server.context import ServerConfig
from tests.conftest import sibling_engine
from tests.server.live import LiveServer

TOOLSETS = load_toolsets()
TASKS = {t.id: t for t in load_tasks(toolsets=TOOLSETS)[0]}


@pytest.fixture(scope="module")
def server(default_engine):
    from prescient.grammar import CompilerConfig, GrammarCompiler, GrammarTokenizer

    engine = sibling_engine(default_engine)
    # A patient compiler: on a loaded 2-core CI machine the first compile (worker start included)
    # can pass the server's 10 s limit, and the limit is not what these tests are about.
    gtok = GrammarTokenizer.from_huggingface(engine.tokenizer.hf, vocab_size=engine.model.config.vocab_size,
                                             stop_token_ids=list(engine.eos_token_ids))
    engine._grammar_compiler = GrammarCompiler(gtok, CompilerConfig(isolate=True, max_workers=2, time_limit_s=300))
    s = LiveServer(engine, ServerConfig(model_name="default"))
    yield s
    s.stop()


def _run(coro_fn):
    return asyncio.run(coro_fn())


def test_a_task_runs_turn_by_turn_with_the_grammar_and_both_transports_agree(server):
    task = TASKS["weather-00"]

    async def go(transport):
        try:
            return await run_task(transport, task, TOOLSETS, f"t-{transport.name}")
        finally:
            await transport.aclose()

    http = _run(lambda: go(ChatHTTPTransport(server.url, "native", 48)))
    ws = _run(lambda: go(ResponsesWSTransport(server.url, 48)))
    for rec in (http, ws):
        assert rec.error is None
        assert 1 <= rec.turns <= task.max_turns == len(task.tool_choice)
        # turn 1 is `required`: the grammar makes it a call, schema-valid
        assert rec.calls and rec.calls[0].turn == 0 and rec.calls[0].name == "get_weather"
        assert rec.num_invalid == 0
        assert [i for i, _, _ in rec.turn_traces] == list(range(rec.turns))
        for _, choice, trace in rec.turn_traces:
            assert trace.emission_times and trace.emission_times[0] > trace.arrival_time
            assert trace.finished_time >= trace.emission_times[-1]
        assert rec.settled == (rec.verdict == "settled")
    # greedy on the same model: the WebSocket's previous_response_id conversation is the same one
    assert [(c.name, json.loads(c.arguments)) for c in ws.calls] == [(c.name, json.loads(c.arguments))
                                                                     for c in http.calls]
    assert ws.final_answer == http.final_answer


def test_without_the_grammar_calls_are_parsed_client_side_and_judged(server):
    task = TASKS["finance-26"]

    async def go():
        transport = ChatHTTPTransport(server.url, "free", 48)
        try:
            return await closed_loop(transport, [task, TASKS["shop-19"]], TOOLSETS, 2, "free")
        finally:
            await transport.aclose()

    records = _run(go)
    assert sorted(r.task.id for r in records) == ["finance-26", "shop-19"]
    for rec in records:
        assert rec.error is None and rec.turns >= 1
        for c in rec.calls:  # whatever the model wrote, each call was judged by the simulator
            assert c.valid == (c.error is None)


def test_server_cpu_seconds_cover_the_process_tree():
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:
        pass
    assert _tree_cpu_s(os.getpid()) >= time.process_time() - 0.05


def _trace(rid: str, arrival: float, ttft: float, gaps: list[float]) -> RequestTrace:
    tr = RequestTrace(rid, arrival)
    t = arrival + ttft
    tr.add_emission(t, 1)
    for g in gaps:
        t += g
        tr.add_emission(t, 2)
    tr.finished_time = t
    return tr


def test_report_figures_follow_their_definitions(tmp_path):
    task = AgentTask("t", "weather", "hi", ("get_weather",), ("required", "auto", "auto"))

    def rec(ttfts, settled=True, invalid=False):
        r = TaskRecord(task, [CallRecord(0, "get_weather", "{}", True)], start=0.0, end=3.0)
        if invalid:
            r.calls.append(CallRecord(1, "nope", "{}", False, "unknown"))
        if settled:
            r.final_answer, r.final_turn = "ok", len(ttfts) - 1
        r.turns = len(ttfts)
        r.turn_traces = [(i, "auto", _trace(f"r{i}", 10.0 * i, x, [0.01, 0.02])) for i, x in enumerate(ttfts)]
        return r

    blocks = [{"system": "prescient-ngram-grammar", "phase": "closed-1", "kind": "closed", "param": 1, "block": 0,
               "wall_s": 30.0, "server_cpu_s": 12.0, "records": [rec([0.4, 0.1]), rec([0.6, 0.2], settled=False)]},
              {"system": "llamacpp", "phase": "closed-1", "kind": "closed", "param": 1, "block": 0, "wall_s": 60.0,
               "server_cpu_s": 40.0, "records": [rec([0.5, 2.0]), rec([0.5, 0.3], invalid=True)]}]
    cfg = AgentBenchConfig(price_per_core_hour=3.6, slo_ttft_s=1.0, slo_itl_s=0.1)
    info = {s: {"server": s, "transport": "http", "tool_format": "native"} for s in ("prescient-ngram-grammar",
                                                                                       "llamacpp")}
    report = build_report(cfg, blocks, info, {"prescient-off": "not started"}, {"path": "x", "sha256": "0" * 64,
                                                                                 "num_tasks": 2})
    ours, peer = report["phases"]["closed-1"]["prescient-ngram-grammar"], report["phases"]["closed-1"]["llamacpp"]
    assert ours["num_settled"] == 1 and ours["settled_per_min"] == pytest.approx(2.0)  # 1 task in 30 s
    assert ours["ttft_turn1_s"]["p50"] == pytest.approx(0.5) and ours["ttft_later_s"]["p50"] == pytest.approx(0.15)
    assert ours["cpu_s_per_settled"] == pytest.approx(12.0)
    assert ours["usd_per_settled"] == pytest.approx(12.0 / 3600 * 3.6)
    assert ours["itl_emission_s"]["max"] == pytest.approx(0.02)
    assert ours["itl_token_s"]["max"] == pytest.approx(0.01)  # a 2-token emission's gap, split
    # the peer's settled task has a 2 s turn-2 TTFT: settled, but not within the SLO
    assert peer["num_settled"] == 1 and peer["goodput_per_min"] == 0.0 and peer["num_invalid_calls"] == 1
    (target,) = report["targets"]
    assert target["settled_per_min_ratio"] == pytest.approx(2.0 / 1.0) and target["settled_per_min_ok"]
    assert target["ttft_later_p50_ratio"] == pytest.approx(0.15 / 1.15)
    write_report(report, tmp_path, plots=True)
    md = (tmp_path / "agent_report.md").read_text()
    assert "prescient-off**: not run: not started" in md and "| closed-1 | llamacpp | 1/2 |" in md
    assert json.loads((tmp_path / "agent_report.json").read_text())["targets"] == report["targets"]
    assert {"agent_ttft_cdf.png", "agent_itl_cdf.png", "agent_turn_latency.png"} <= set(report["plots"])
    assert all((tmp_path / p).stat().st_size > 1000 for p in report["plots"])


def test_cli_flags_make_the_config():
    from prescient.latency_bench.agent_bench import _parser, config_from_args

    cfg = config_from_args(_parser().parse_args(["--quick", "--no-peer", "--rates", "5,10", "--ttft-slo-ms", "500",
                                                 "--price-per-core-hour", "0.1"]))
    assert cfg.quick and "llamacpp" not in cfg.systems and cfg.open_rates_per_min == (5.0, 10.0)
    assert cfg.slo.ttft_s == 0.5 and cfg.price_per_core_hour == 0.1
    with pytest.raises(SystemExit, match="unknown systems"):
        config_from_args(_parser().parse_args(["--systems", "vllm"]))



def test_bench_agents_is_a_bare_flag_and_agents_n_stays_the_load_count():
    from prescient.latency_bench.suites import UnknownSuite, resolve

    assert resolve(["--agents", "--quick"]) == ("agents", ["--quick"])
    assert resolve(["agents", "--quick"]) == ("agents", ["--quick"])
    assert resolve(["--agents", "4", "--quick"]) == ("latency", ["--agents", "4", "--quick"])
    assert resolve(["--quick", "--agents", "4"]) == ("latency", ["--quick", "--agents", "4"])
    assert resolve(["--quick"]) == ("latency", ["--quick"])
    with pytest.raises(UnknownSuite, match="put it first"):  # a suite flag only in the suite name's place
        resolve(["--quick", "--agents"])
