"""Smoke test of latency_bench/grammar_compliance.py: a few schemas per file, every random walk
through the compiled grammar validates against its schema."""

from __future__ import annotations

from prescient.latency_bench.grammar_compliance import ComplianceConfig, markdown, run


def test_compliance_report_on_a_sample(toy_tokenizer):
    config = ComplianceConfig(files=("maskbench_bfcl.jsonl", "Glaiveai2K.jsonl", "Github_hard.jsonl"),
                              limit=12, walks_per_schema=2)
    report = run(config, toy_tokenizer)
    for name, result in report["files"].items():
        assert result["schemas"] == 12
        assert result["compiled"] + result["refused"] + result["compile_errors"] == 12
        assert result["walks"] > 0 and result["walks_valid"] == result["walks"], result
        assert result["invalid_outputs"] == []
        assert result["exact"] + result["narrowed"] == result["compiled"]
    text = markdown(report)
    assert "| maskbench_bfcl.jsonl | 12 |" in text and "refused by feature" in text


def test_walks_through_the_auto_backend_validate_and_name_who_served(toy_tokenizer):
    """The server's default backend: llguidance serves what it accepts exactly, xgrammar the rest;
    every walk through either validates, and the report says how many each compiled."""
    config = ComplianceConfig(files=("Github_hard.jsonl",), limit=12, walks_per_schema=2, backend="auto")
    result = run(config, toy_tokenizer)["files"]["Github_hard.jsonl"]
    assert sum(result["served_by"].values()) == result["compiled"]
    assert result["served_by"].get("llguidance", 0) > 0
    assert result["walks"] > 0 and result["walks_valid"] == result["walks"], result
    assert result["invalid_outputs"] == []
