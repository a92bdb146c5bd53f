"""The load generators' pieces without a model: arrival processes, workload selection, the
simulated tools, decode-step accounting and the efficiency arithmetic."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from prescient.latency_bench.efficiency import decode_efficiency, flops_per_token, kv_bytes_per_token, matmul_params
from prescient.latency_bench.modes import ModeSpec, decode_steps, default_modes
from prescient.latency_bench.open_loop import arrival_offsets, best_rate
from prescient.latency_bench.workloads import KINDS, load_workloads, select, tool_result
from prescient.runtime.config import ModelConfig
from prescient.runtime.slo import RequestTrace


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 1.0), ("gamma", 3.0), ("gamma", 0.3)])
def test_arrivals_have_the_asked_rate_and_burstiness(process, cv):
    offsets = arrival_offsets(4.0, 20001, process, cv, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.08)
    assert arrival_offsets(4.0, 50, process, cv, seed=1) == offsets[:50]  # seeded: the same schedule


def test_bad_arrivals_refused():
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(0, 3)
    with pytest.raises(ValueError, match="arrival process"):
        arrival_offsets(1.0, 3, "uniform")


def test_best_rate_is_the_highest_meeting_the_target():
    pts = [{"rate_rps": 1, "slo_attainment": 1.0}, {"rate_rps": 2, "slo_attainment": 0.95},
           {"rate_rps": 4, "slo_attainment": 0.5}]
    assert best_rate(pts, 0.9) == 2 and best_rate(pts, 0.99) == 1 and best_rate(pts[2:], 0.9) is None


def test_workloads_load_and_select():
    ws, meta = load_workloads()
    assert len(ws) == meta["num_workloads"] == 11 and len(meta["sha256"]) == 64
    assert {w.kind for w in ws} == set(KINDS)
    two = select(ws, 2, max_tokens_cap=50)
    assert [w.kind for w in two] == ["chat", "chat", "tool_call", "tool_call", "long_edit", "long_edit"]
    assert all(w.max_tokens <= 50 for w in two) and two[0].index == 0
    assert select(ws, None) == ws


def test_tool_results_answer_calls_and_drift():
    weather = json.loads(tool_result('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}', 0))
    assert weather["tool"] == "get_weather" and weather["result"]["temperature"] == round(-3 * 9 / 5 + 32)
    flights = json.loads(tool_result('Sure! {"name": "search_flights", "arguments": {"origin": "SFO", '
                                     '"destination": "JFK", "date": "2026-12-24"}} done', 1))
    assert len(flights["result"]["flights"]) == 3 and flights["turn"] == 1
    assert json.loads(tool_result("I cannot help with that.", 2))["result"]["error"]
    assert tool_result("{not json", 0) == tool_result("{not json", 0)


def test_decode_steps_follow_context_growth():
    trace = RequestTrace("r", 0.0)
    for t, n in [(0.1, 1), (0.2, 3), (0.3, 1)]:
        trace.add_emission(t, n)
    assert decode_steps(trace, num_prompt_tokens=10) == [(11, 3), (14, 1)]


def test_efficiency_arithmetic():
    cfg = ModelConfig("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4)
    per_layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16
    assert matmul_params(cfg) == 2 * per_layer + 100 * 8
    assert flops_per_token(cfg, 10) == 2 * matmul_params(cfg) + 4 * 2 * 2 * 4 * 10
    kvb = kv_bytes_per_token(cfg, torch.bfloat16)
    assert kvb == 2 * 2 * 1 * 4 * 2
    # two steps, 1 s: reads 2 x (1000 + ctx * kvb) bytes against 10 kB/s
    eff = decode_efficiency([(5, 1), (6, 2)], 1.0, 1000, kvb, cfg, bandwidth=10_000.0, peak_flops=1e6)
    assert eff["bandwidth_util"] == pytest.approx((2000 + 11 * kvb) / 10_000)
    assert eff["mfu"] == pytest.approx((flops_per_token(cfg, 5) + 2 * flops_per_token(cfg, 6)) / 1e6)


def test_mode_names_and_defaults():
    assert ModeSpec("prescient", "bfloat16", "ngram").name == "prescient-bf16-ngram"
    assert ModeSpec("hf", "float32", prompt_lookup=10).name == "hf-fp32-pld10"
    assert ModeSpec("hf", "float32", prompt_lookup=10).plain_name == "hf-fp32"
    names = [m.name for m in default_modes(("float32", "bfloat16"), "bfloat16")]
    assert names == ["prescient-fp32", "hf-fp32", "prescient-bf16", "hf-bf16", "prescient-bf16-ngram",
                     "prescient-bf16-draft", "hf-bf16-pld10", "prescient-bf16-ngram-grammar", "prescient-bf16-grammar",
                     "llamacpp-bf16"]
    assert ModeSpec("prescient", "bfloat16", "ngram", grammar=True).unconstrained_name == "prescient-bf16-ngram"


def test_concurrency_decode_rates_leave_prefill_out():
    from prescient.latency_bench.concurrency import _stream_decode_rate, _steady_decode_rate

    def trace(times, counts=None):
        t = RequestTrace("x", 0.0)
        for ts, n in zip(times, counts or [1] * len(times)):
            t.add_emission(ts, n)
        return t

    # batch 1: 3 tokens after the first over 0.3 s, twice
    assert _stream_decode_rate([trace([1.0, 1.1, 1.2, 1.3]), trace([5.0, 5.1, 5.2, 5.3])]) == pytest.approx(10.0)
    # two at once: both decode from t=2 (the later first token) to t=4 (the earlier last token);
    # 1 + 1 tokens per 0.5 s step in (2, 4] -> 8 tokens over 2 s
    a = trace([1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0])
    b = trace([2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    assert _steady_decode_rate([a, b], 2) == pytest.approx(4.0)
