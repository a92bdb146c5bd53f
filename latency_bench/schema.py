"""JSON Schema of the report (`report.json`): the stable field names other tools may rely on.

Bump SCHEMA_VERSION when a field is renamed or removed; adding fields is compatible. Times are
seconds, rates per second, bandwidth bytes per second, ratios plain numbers (1.0 = equal).
"""

from __future__ import annotations

SCHEMA_VERSION = 2  # 2: one latency model (per-emission SLO, no itl_basis / itl_p99_overall_s)

NUM = {"type": ["number", "null"]}
INT = {"type": "integer"}
STR = {"type": "string"}

DISTRIBUTION = {
    "type": "object",
    "required": ["count", "mean", "p50", "p90", "p99", "max"],
    "properties": {"count": INT, "mean": NUM, "p50": NUM, "p90": NUM, "p99": NUM, "max": NUM},
}

SUMMARY = {
    "type": "object",
    "required": ["num_requests", "num_output_tokens", "duration_s", "queue_s", "ttft_s", "itl_token_s",
                 "itl_emission_s", "tpot_s", "e2e_s", "accepted_len", "decode_tok_s", "output_tok_s",
                 "throughput_rps", "goodput_rps", "slo_attainment", "slo_attainment_by_slo"],
    "properties": {
        "num_requests": INT, "num_output_tokens": INT, "duration_s": NUM,
        **{k: {"$ref": "#/$defs/distribution"} for k in
           ("queue_s", "ttft_s", "itl_token_s", "itl_emission_s", "tpot_s", "e2e_s", "accepted_len")},
        "decode_tok_s": NUM, "output_tok_s": NUM, "throughput_rps": NUM, "goodput_rps": NUM,
        "slo_attainment": NUM, "slo_attainment_by_slo": {"type": "object", "additionalProperties": {"type": "number"}},
    },
}

MODE_SPEC = {
    "type": "object",
    "required": ["name", "engine", "dtype", "speculate", "prompt_lookup_num_tokens"],
    "properties": {"name": STR, "engine": STR, "dtype": STR, "speculate": STR,
                   "prompt_lookup_num_tokens": {"type": ["integer", "null"]}, "grammar": {"type": "boolean"},
                   "available": {"type": "boolean"}, "reason": {"type": ["string", "null"]}},
}

MODE_RESULT = {
    "type": "object",
    "required": ["spec", "weight_bytes", "floor_tok_s", "decode_tok_s", "pct_of_floor", "bandwidth_util", "mfu",
                 "summary", "by_workload", "stats", "foreign_cpu_mean", "retried_runs"],
    "properties": {
        "spec": {"$ref": "#/$defs/mode_spec"}, "weight_bytes": INT, "floor_tok_s": NUM, "decode_tok_s": NUM,
        "pct_of_floor": NUM, "bandwidth_util": NUM, "mfu": NUM, "summary": {"$ref": "#/$defs/summary"},
        "by_workload": {"type": "object", "additionalProperties": {"$ref": "#/$defs/summary"}},
        "stats": {"type": "object"}, "foreign_cpu_mean": NUM, "retried_runs": INT, "decode_tok_s_median_run": NUM,
    },
}

RUN = {
    "type": "object",
    "required": ["mode", "workload", "prompt", "rep", "num_prompt_tokens", "num_output_tokens", "ttft_s", "tpot_s",
                 "e2e_s", "decode_tok_s", "mean_accepted_len", "met_all", "foreign_cpu", "attempts",
                 "emission_offsets_s", "emission_tokens"],
    "properties": {
        "mode": STR, "workload": STR, "prompt": STR, "rep": INT, "num_prompt_tokens": INT, "num_output_tokens": INT,
        "queue_s": NUM, "ttft_s": NUM, "tpot_s": NUM, "e2e_s": NUM, "decode_tok_s": NUM, "mean_accepted_len": NUM,
        "itl_emission_p99_s": NUM, "met_all": {"type": "boolean"}, "foreign_cpu": NUM, "attempts": INT,
        "emission_offsets_s": {"type": "array", "items": {"type": "number"}},
        "emission_tokens": {"type": "array", "items": INT},
    },
}

LOAD_RUN = {
    "type": "object",
    "required": ["mode", "latency"],
    "properties": {"mode": STR, "latency": {"$ref": "#/$defs/summary"}, "engine": {"type": "object"}},
}

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "prescient latency_bench report",
    "type": "object",
    "required": ["schema_version", "tool", "created_utc", "command", "quick", "wall_s", "config", "machine", "model",
                 "workloads", "slo", "modes", "batch1", "comparisons", "verify_cost", "concurrency", "load", "plots",
                 "notes"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "tool": {"const": "prescient.latency_bench"},
        "created_utc": STR, "command": {"type": "array", "items": STR}, "quick": {"type": "boolean"}, "wall_s": NUM,
        "config": {"type": "object"},
        "machine": {
            "type": "object",
            "required": ["cpu", "num_cpus", "torch_threads", "dram_read_bytes_s", "gemm_peak_flops"],
            "properties": {"dram_read_bytes_s": {"type": "number"},
                           "gemm_peak_flops": {"type": "object", "additionalProperties": {"type": "number"}}},
        },
        "model": {"type": "object", "required": ["path", "name", "matmul_params", "kv_bytes_per_token"]},
        "workloads": {"type": "object", "required": ["path", "sha256", "selected"]},
        "slo": {"type": "object", "required": ["name", "ttft_s", "itl_emission_p99_s", "tpot_s", "e2e_s"]},
        "modes": {"type": "array", "items": {"$ref": "#/$defs/mode_spec"}},
        "batch1": {
            "type": "object", "required": ["reps", "modes", "runs"],
            "properties": {"reps": INT,
                           "modes": {"type": "object", "additionalProperties": {"$ref": "#/$defs/mode_result"}},
                           "runs": {"type": "array", "items": {"$ref": "#/$defs/run"}}},
        },
        "comparisons": {
            "type": "object", "required": ["issue2", "speculation", "grammar", "agreement"],
            "properties": {
                "issue2": {"type": "array", "items": {"type": "object", "required": [
                    "dtype", "prescient_tok_s", "hf_tok_s", "tok_s_ratio", "prescient_ttft_p50_s", "hf_ttft_p50_s",
                    "floor_tok_s", "prescient_pct_of_floor", "hf_pct_of_floor"]}},
                "speculation": {"type": "array", "items": {"type": "object", "required": [
                    "mode", "baseline", "workload", "plain_tok_s", "spec_tok_s", "speedup", "e2e_speedup",
                    "mean_accepted_len"]}},
                "grammar": {"type": "array", "items": {"type": "object", "required": [
                    "mode", "baseline", "workload", "plain_tok_s", "spec_tok_s", "speedup", "e2e_speedup"]}},
                "agreement": {"type": "array", "items": {"type": "object", "required": [
                    "mode", "reference", "identical", "mean_common_prefix"]}},
            },
        },
        "verify_cost": {"type": "array", "items": {"type": "object", "required": ["dtype", "context_len", "rows"],
                        "properties": {"rows": {"type": "array", "items": {"type": "object", "required": [
                            "k", "ms", "ratio_vs_1", "ms_per_token"]}}}}},
        "concurrency": {"type": "array", "items": {"type": "object", "required": [
            "dtype", "num_concurrent", "batch1", "concurrent", "ratio", "decode_ratio"]}},
        "load": {
            "type": "object", "required": ["client", "closed_loop", "open_loop", "sweep", "max_rate_meeting_slo"],
            "properties": {
                "client": STR,
                "closed_loop": {"type": "array", "items": {"allOf": [{"$ref": "#/$defs/load_run"}, {
                    "type": "object", "required": ["agents"],
                    "properties": {"agents": {"type": "object", "required": [
                        "completed_tasks", "cpu_s_per_task", "task_latency_s"]}}}]}},
                "open_loop": {"type": "array", "items": {"$ref": "#/$defs/load_run"}},
                "sweep": {"type": "array", "items": {"type": "object", "required": [
                    "mode", "rate_rps", "goodput_rps", "slo_attainment"]}},
                "max_rate_meeting_slo": {"type": "object", "additionalProperties": NUM},
            },
        },
        "plots": {"type": "array", "items": STR},
        "notes": {"type": "array", "items": STR},
    },
    "$defs": {"distribution": DISTRIBUTION, "summary": SUMMARY, "mode_spec": MODE_SPEC, "mode_result": MODE_RESULT,
              "run": RUN, "load_run": LOAD_RUN},
}
