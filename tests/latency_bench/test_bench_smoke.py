"""Smoke run of the whole benchmark on a tiny model, in-process: every phase runs, the report
validates against its JSON schema, the Markdown and the plots are written."""

from __future__ import annotations

import json

import jsonschema
import pytest

from prescient.cli import main
from prescient.latency_bench.schema import REPORT_SCHEMA

# float32 only (one prescient model, one transformers model): the fastest set that still runs every
# phase and every kind of mode; fp32 greedy outputs of the two engines must agree token for token.
ARGS = ["--quick", "--peers", "--dtypes", "float32", "--spec-dtype", "float32", "--prompts-per-kind", "1",
        "--max-tokens-cap", "6", "--concurrent", "4",
        "--concurrent-max-tokens", "4", "--agents", "2", "--turns", "2", "--tool-latency", "0.01",
        "--agent-max-tokens", "6", "--open-requests", "3", "--rate", "50", "--bandwidth-mb", "64", "--gemm-n", "256",
        "--kv-cache-gb", "0.02", "--verify-context", "32", "--no-progress", "--sweep", "--sweep-requests", "2"]


def short_workloads(path):
    """One prompt per kind, shortened (a 3-item document to edit, one declared tool) so that
    prefill stays small: this test checks the report's shape, not the workloads' figures."""
    doc = json.dumps([{"sku": f"SKU-{i}", "qty": i} for i in range(3)])
    tool = json.dumps({"name": "get_weather", "parameters": {"city": "string"}})
    rows = [
        {"workload": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "What is a hash table?"}]},
        {"workload": "tool_call", "max_tokens": 8, "messages": [
            {"role": "system", "content": f"Reply with a JSON tool call. Tools: {tool}"},
            {"role": "user", "content": "Weather in Paris?"}]},
        {"workload": "long_edit", "max_tokens": 8, "messages": [
            {"role": "user", "content": doc + "\n\nReturn the array with every qty increased by 1."}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def report_dir(tiny_chat_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    workloads = short_workloads(out / "workloads.jsonl")
    assert main(["bench", *ARGS, "--model", str(tiny_chat_model_dir), "--workloads", str(workloads),
                 "--out", str(out)]) == 0
    return out


def test_report_is_well_formed(report_dir):
    report = json.loads((report_dir / "report.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    modes = report["batch1"]["modes"]
    for name in ("prescient-fp32", "hf-fp32", "prescient-fp32-ngram", "hf-fp32-pld10"):
        assert name in modes, name
        assert modes[name]["summary"]["num_requests"] == 3  # one prompt per kind
        assert modes[name]["decode_tok_s"] > 0
    # every unconstrained batch-1 run generated exactly the capped number of tokens (a random model
    # never stops); a grammar may end its reply sooner
    assert all(r["num_output_tokens"] == 6 for r in report["batch1"]["runs"] if not r["mode"].endswith("-grammar"))
    assert "prescient-fp32-ngram-grammar" in modes
    assert {r["workload"] for r in report["comparisons"]["grammar"]} >= {"tool_call", "long_edit"}
    # prescient and transformers run the same float32 weights greedily: same tokens
    fp32 = next(a for a in report["comparisons"]["agreement"]
                if a["mode"] == "prescient-fp32" and a["reference"] == "hf-fp32")
    assert fp32["identical"] == 1.0
    assert [r["dtype"] for r in report["comparisons"]["issue2"]] == ["float32"]
    assert {r["workload"] for r in report["comparisons"]["speculation"]} == {"all", "chat", "tool_call", "long_edit"}
    assert [r["k"] for r in report["verify_cost"][0]["rows"]][0] == 1
    concurrency = report["concurrency"][0]
    assert concurrency["batch1"]["output_tokens"] == concurrency["concurrent"]["output_tokens"]
    closed = report["load"]["closed_loop"][0]
    assert closed["agents"]["completed_tasks"] == 2 and closed["latency"]["num_requests"] == 4
    assert report["load"]["open_loop"][0]["latency"]["num_requests"] == 3
    # the rate sweep ran (forced on in this quick run): every factor per load mode, a goodput each
    sweep = report["load"]["sweep"]
    assert len({p["rate_rps"] for p in sweep}) >= 5 and all(p["goodput_rps"] is not None for p in sweep)
    assert "max_rate_meeting_slo" in report["load"]
    unavailable = {m["name"]: m["reason"] for m in report["modes"] if not m["available"]}
    assert "llamacpp-fp32" in unavailable or "llamacpp-fp32" in modes


def test_markdown_and_plots_written(report_dir):
    report = json.loads((report_dir / "report.json").read_text())
    md = (report_dir / "report.md").read_text()
    assert "prescient vs transformers" in md and "SLOs used" in md
    for name in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline.png", "accept_hist.png", "verify_cost.png",
                 "goodput_vs_rate.png"):
        assert name in report["plots"]
        assert (report_dir / name).stat().st_size > 1000
