"""`prescient bench attention` (latency_bench/attention_bench.py): each case prints one row, in
order, for a bf16 and an int8 cache; GB/s counts the K/V bytes the queries see; a malformed shape
or context is refused by name. Tiny caches and one rep: this checks the benchmark, it measures
nothing."""

from __future__ import annotations

import pytest
import torch

from prescient.kernels import cpu_attention
from prescient.latency_bench import attention_bench

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="C attention kernel unavailable")


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["tier", "shape"])
    return [line.split() for line in lines[head + 1:] if line.strip() and not line.startswith("(")]


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_each_case_prints_one_row_in_order(kv, capsys):
    assert attention_bench.cli(["--contexts", "40,70", "--shapes", "1x1,2x3", "--reps", "1",
                                "--layers", "2", "--kv", kv]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [(r[1], r[2]) for r in rows] == [("1x1", "40"), ("2x3", "40"), ("1x1", "70"), ("2x3", "70")]
    for row in rows:
        assert len(row) == 8 and all(float(x) >= 0 for x in row[3:])


@pytest.mark.parametrize("kv, esz", [("bfloat16", 2), ("int8", 1)])
def test_the_figures_count_the_bytes_the_queries_see(kv, esz):
    """GB/s: every sequence's context, K and V, every layer, once (an int8 cache's scales too)."""
    g = torch.Generator().manual_seed(0)
    cache = attention_bench.Cache(layers=2, blocks=40, kv=kv, g=g)
    probe = torch.ones(1 << 16)
    r = attention_bench.run_case(cache, 2, seqs=3, qlen=2, ctx=100, dt=torch.bfloat16, reps=1, g=g, probe=probe)
    per_position = attention_bench.KV_HEADS * (attention_bench.HEAD_DIM * esz + (4 if kv == "int8" else 0)) * 2
    assert r["gbs"] == pytest.approx(2 * 3 * 100 * per_position / r["ms"] / 1e6)
    assert r["ms"] > 0 and r["floor_ms"] > 0 and r["hot_ms"] > 0


def test_a_malformed_shape_is_refused_by_name():
    with pytest.raises(SystemExit, match="8y1"):
        attention_bench.cli(["--shapes", "1x1,8y1", "--layers", "1"])


@pytest.mark.parametrize("argv, named", [(["--contexts", "64,lots"], "lots"), (["--contexts", "0"], "'0'"),
                                         (["--contexts", "4", "--shapes", "1x5"], "5 tokens")])
def test_a_bad_context_is_refused_by_name(argv, named):
    with pytest.raises(SystemExit, match=named):
        attention_bench.cli([*argv, "--layers", "1"])
