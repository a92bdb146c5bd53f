"""Cost of a k-token verify step relative to a 1-token decode step, for the report.

The measurement is the engine's own (speculative/verify_cost.py: the forwards the planner's
table comes from, built as the engine builds them): k = 1 as plain decoding runs it, k > 1 as a
chain draft is verified. The report gives the median of each k (the planner keeps the best)
beside the best, and k x the 1-token time to compare against.
"""

from __future__ import annotations

import statistics

from prescient.speculative.verify_cost import measure_forward_seconds


def measure_verify_cost(model, context_len: int = 512, ks: tuple[int, ...] = (1, 2, 4, 8, 11, 16),
                        reps: int = 7, block_size: int = 16) -> dict:
    samples = measure_forward_seconds(model, block_size, ks, context_len, reps)
    base = statistics.median(samples[1])
    rows = []
    for k in sorted(samples):
        med = statistics.median(samples[k])
        rows.append({"k": k, "ms": med * 1e3, "ms_min": min(samples[k]) * 1e3, "ratio_vs_1": med / base,
                     "ms_per_token": med * 1e3 / k})
    return {"dtype": str(model.dtype).replace("torch.", ""), "context_len": context_len, "reps": reps, "rows": rows}
