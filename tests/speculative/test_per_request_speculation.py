"""Per-request speculation: a request's own ITL bound caps the draft plan through its measured
gaps (for the whole batch's shared forward), `speculate=False` drafts nothing, and the
verify-cost table is measured again, in idle moments, once batch-1 forwards drift from it."""

from __future__ import annotations

import math

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.request import SOURCE_TARGET
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.ngram import NgramProposer
from prescient.speculative.speculator import Speculator
from prescient.speculative.verify_cost import CostTables, DriftMonitor

COST = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5, 16: 2.0}


def planner() -> AdaptiveSpeculation:
    return AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=16, prior_acceptance=0.9, verify_cost=COST))


def test_an_itl_bound_caps_the_forward_at_the_requests_slack():
    free = planner().plan(["r"], 1)[0]
    assert free > 3  # high acceptance, cheap verify: a long draft when unbounded
    adaptive = planner()
    adaptive.observe_gap("r", 0.030, 1.0)  # 30 ms per unit of cost
    # 36 ms allow a forward of cost 1.2: 4 tokens (the root and 3 drafts); 5 would cost 1.275
    assert adaptive.plan(["r"], 1, itl_bounds=[0.036])[0] == 3
    assert adaptive.plan(["r"], 1, itl_bounds=[1.0])[0] == free  # ample slack: no cap
    assert adaptive.plan(["r"], 1, itl_bounds=[0.020])[0] == 0  # no slack: plain decoding
    assert adaptive.plan(["r"], 1, itl_bounds=[None])[0] == free


def test_the_bound_of_one_request_caps_the_shared_forward():
    adaptive = planner()
    adaptive.observe_gap("tight", 0.030, 1.0)
    budgets = adaptive.plan(["tight", "loose"], 2, itl_bounds=[0.036, None])
    assert adaptive.cost_many(torch.tensor([2 + sum(budgets)]).numpy())[0] <= 0.036 / 0.030 + 1e-9
    assert sum(planner().plan(["tight", "loose"], 2)) > sum(budgets)


def test_gaps_are_measured_per_unit_of_forward_cost():
    adaptive = planner()
    adaptive.observe_gap("r", 0.060, 2.0)  # a 2x forward took 60 ms: 30 ms per unit
    assert adaptive.max_forward_cost(["r"], [0.045]) == pytest.approx(1.5)
    assert adaptive.max_forward_cost(["r"], [None]) == math.inf
    assert adaptive.max_forward_cost(["new"], [0.045]) == math.inf  # nothing measured yet


def test_no_probes_past_the_bound():
    adaptive = AdaptiveSpeculation(AdaptiveConfig(prior_acceptance=0.0, probe_interval=1, verify_cost=COST))
    adaptive.observe_gap("r", 0.030, 1.0)
    assert any(adaptive.plan(["free"], 1)[0] for _ in range(4))  # probes come when unbounded
    assert not any(adaptive.plan(["r"], 1, itl_bounds=[0.031])[0] for _ in range(4))


TABLES = CostTables(dict(COST), 256, 1024, {t: c * 1.1 for t, c in COST.items()}, short_base_s=0.010,
                    long_base_s=0.014)


def test_expected_seconds_interpolate_by_size_and_context():
    assert TABLES.expected_seconds(1, 256) == pytest.approx(0.010)
    assert TABLES.expected_seconds(3, 256) == pytest.approx(0.010 * 1.15)
    assert TABLES.expected_seconds(1, 1024) == pytest.approx(0.014 * 1.1)
    assert TABLES.expected_seconds(1, 640) == pytest.approx((0.010 + 0.014 * 1.1) / 2)
    assert CostTables(dict(COST)).expected_seconds(1, 256) is None


def test_drift_is_flagged_only_past_the_tolerance():
    steady = DriftMonitor(TABLES, tolerance=0.3, min_samples=8)
    slower = DriftMonitor(TABLES, tolerance=0.3, min_samples=8)
    for i in range(40):
        steady.observe(TABLES.expected_seconds(4, 256) * (1.1 if i % 2 else 0.9), 4, 256)
        slower.observe(TABLES.expected_seconds(4, 256) * 2.0, 4, 256)
        assert not steady.drifted
        assert slower.drifted == (i + 1 >= 8)
    ignored = DriftMonitor(TABLES, min_samples=1)
    ignored.observe(1.0, 64, 256)  # larger than anything the tables measured
    ignored.observe(1.0, 1, 4096)  # a context far past the long one
    assert ignored.num_samples == 0


def test_without_base_times_the_first_forwards_are_the_reference():
    monitor = DriftMonitor(CostTables(dict(COST)), min_samples=4)
    for _ in range(4):
        monitor.observe(0.5, 1, 256)
    for _ in range(10):
        monitor.observe(0.5 * 1.2, 4, 256)  # as the table predicts for 4 tokens
    assert not monitor.drifted
    for _ in range(30):
        monitor.observe(1.5, 1, 256)
    assert monitor.drifted


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


class FakeCalibration:
    """Stands for verify_cost.Calibration: done after `forwards` idle steps."""

    def __init__(self, tables: CostTables, forwards: int = 2):
        self.tables, self.left = tables, forwards

    def step(self) -> bool:
        self.left -= 1
        return self.left <= 0


def _engine(model, speculator) -> Engine:
    config = EngineConfig(dtype="float64", cache=CacheConfig(block_size=16, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    return Engine(model, None, config, eos_token_ids=(), speculator=speculator)


def _generate(engine: Engine, prompt: list[int], **params):
    request = engine.add_request(prompt, SamplingParams(**{"temperature": 0, "max_tokens": 48, "ignore_eos": True,
                                                           **params}))
    while engine.has_unfinished_requests():
        engine.step()
    return request


COPYABLE = [5, 6, 7, 8, 9, 10, 11, 12] * 6  # a loop the n-gram index predicts


def _speculator(**kwargs) -> Speculator:
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, verify_cost={1: 1.0, 8: 1.05, 16: 1.1}))
    return Speculator(NgramProposer(), 16, adaptive, **kwargs)


def test_per_request_options_in_the_engine(tiny):
    plain = _generate(_engine(tiny, None), COPYABLE).output_token_ids
    engine = _engine(tiny, _speculator())
    free = _generate(engine, COPYABLE)
    off = _generate(engine, COPYABLE, speculate=False)
    # a bound no forward can meet: after the first measured gap, plain decoding
    bounded = _generate(engine, COPYABLE, max_itl_s=1e-7)
    for request in (free, off, bounded):
        assert request.output_token_ids == plain
    assert free.num_draft_tokens > 0
    assert off.num_draft_tokens == 0 and set(off.token_sources) == {SOURCE_TARGET}
    assert bounded.num_draft_tokens < free.num_draft_tokens
    assert bounded.num_verify_steps <= 2  # drafts only before its gaps were measured


def test_the_table_is_measured_again_when_forwards_drift(tiny):
    stale = CostTables({1: 1.0, 8: 1.05, 16: 1.1}, short_base_s=1e-7)  # claims 0.1 us forwards
    fresh = CostTables({1: 1.0, 8: 1.3, 16: 1.6}, short_base_s=1.0)
    made = []

    def recalibrate():
        made.append(FakeCalibration(fresh))
        return made[-1]

    spec = _speculator(recalibrate=recalibrate, tables=stale, recalibrate_interval_s=0.0)
    engine = _engine(tiny, spec)
    _generate(engine, COPYABLE)
    assert len(made) == 1 and spec.calibration is made[0]  # pending: nothing measured mid-request
    assert spec.adaptive.verify_cost(8) == pytest.approx(1.05)
    while engine.idle_work():  # what the server's loop runs while no request is queued
        pass
    assert spec.calibration is None and spec.adaptive.verify_cost(8) == pytest.approx(1.3)
    assert spec.drift is not None and spec.drift.tables is fresh

    patient = _speculator(recalibrate=recalibrate, tables=stale, recalibrate_interval_s=3600.0)
    _generate(_engine(tiny, patient), COPYABLE)
    assert patient.calibration is None and len(made) == 1  # at most one measurement an interval


def test_only_decode_and_verify_forwards_are_held_against_the_table(tiny):
    """A prompt's last chunk also samples, but it is a causal prefill with one logits row: the
    tables price tree verifies with a row each, so it would read as drift."""
    tables = CostTables({1: 1.0, 8: 1.3, 16: 1.6}, short_base_s=1e-3)
    spec = _speculator(recalibrate=lambda: FakeCalibration(tables), tables=tables, recalibrate_interval_s=3600.0)
    engine = _engine(tiny, spec)
    _generate(engine, list(range(5, 25)), max_tokens=1)  # one forward: the 20-token prefill
    assert spec.drift.num_samples == 0
    _generate(engine, list(range(5, 25)), max_tokens=4)  # the prefill, then three decode steps
    assert 1 <= spec.drift.num_samples <= 3
