"""The real default model, end to end (latency_bench/invariance_check.py): greedy output with
n-gram speculation is token-identical to plain decoding on all 11 shared workloads, every
request of a batch gives the tokens it gives alone, and so does each workload chunked by
default and served again from the prefix cache, in native Q4_1 and bf16 weights, on this
CPU's best ISA tier and on AVX2 (the tier of CPUs without AVX-512). Tokens are capped to keep it
to about a minute a case; the command runs the full lengths on every tier."""

from __future__ import annotations

import io

import pytest

from prescient.kernels import cpu_linear
from prescient.latency_bench.invariance_check import check


def _tiers() -> list[str]:
    tiers = cpu_linear.machine_tiers()
    return sorted({tiers[-1], "avx2"} & set(tiers), key=tiers.index)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["native", "bfloat16"])
def test_speculation_and_batching_do_not_change_greedy_tokens(weights):
    tiers = _tiers()
    if not tiers or not cpu_linear.available():
        pytest.skip("no native kernels on this CPU")
    log = io.StringIO()
    rows = check(weights, tiers, max_tokens=24, batch=12, out=log)
    for row in rows:
        assert row["spec_identical"] == row["workloads"], log.getvalue()
        assert row["batch_identical"] == row["batch"], log.getvalue()
        assert row["cache_identical"] == row["workloads"], log.getvalue()
