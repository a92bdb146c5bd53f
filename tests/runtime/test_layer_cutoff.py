"""A step's split prefill chunk stops at its cutoff: the time budget's plan is a prediction, so
the layers of a chunk split by layers run after the step's decode rows and no more of them start
once `itl_cutoff` x the ITL bound has passed (runtime/forward_plan.py). Checked with a clock of
the tests' own (which layer it stops at) and with a model slower than the cost model predicts (a
step cut short, later steps going on from there, the same greedy output as uncut; the cost model
told the shape as it ran). A chunk whose logits row a grammar bitmask counts on is never cut."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from prescient.runtime import forward_plan
from prescient.runtime.config import SchedulerConfig
from prescient.runtime.forward_plan import _forward_split, _layers_until, run_forward
from prescient.runtime.scheduler import ScheduledSeq, Scheduler
from prescient.runtime.step_cost import shape_after_cut, step_shape
from tests.runtime.test_time_budget import (FakeCost, greedy, make_engine, prompt, spied_step,  # noqa: F401
                                             start_decodes, tiny)


class FakeLayers:
    """forward_layers that advance a fake clock by `per_layer[i]` for layer i and log the calls."""

    keep_hidden = False
    config = SimpleNamespace(vocab_size=4)
    device = torch.device("cpu")

    def __init__(self, clock: list[float], per_layer: list[float]):
        self.clock, self.per_layer, self.calls = clock, per_layer, []

    def forward_layers(self, batch, kv_caches, h, start, stop):
        self.calls.append((start, stop))
        self.clock[0] += sum(self.per_layer[start:stop])
        return (h if h is not None else 0) + (stop - start)  # h counts the layers run

    def forward_head(self, batch, h):
        return torch.zeros(1, 4)


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(forward_plan, "_now", lambda: now[0])
    return now


def test_layers_stop_where_the_next_would_end_past_the_cutoff(clock):
    model = FakeLayers(clock, [0.010] * 8)
    h, reached = _layers_until(model, None, None, None, 0, 8, cutoff=100.045)
    assert reached == 4 and h == 4  # layers end at 100.010, .030, .040; a fifth would end at .050
    assert model.calls == [(0, 1), (1, 3), (3, 4)]  # the first alone (the estimate), then groups of 2
    assert clock[0] <= 100.045


def test_without_a_late_step_every_planned_layer_runs_in_a_few_calls(clock):
    model = FakeLayers(clock, [0.010] * 8)
    _, reached = _layers_until(model, None, None, None, 2, 8, cutoff=200.0)
    assert reached == 8
    assert model.calls[0] == (2, 3) and model.calls[-1][1] == 8 and len(model.calls) <= 5


def test_a_step_already_past_its_cutoff_still_runs_one_layer(clock):
    model = FakeLayers(clock, [0.010] * 8)
    _, reached = _layers_until(model, None, None, None, 3, 8, cutoff=99.0)
    assert reached == 4 and model.calls == [(3, 4)]


def test_no_layer_runs_unmeasured_past_the_cutoff(clock):
    # 1 ms left, 32 planned layers of 10 ms: the first layer alone (what it takes is the only
    # estimate there is), then nothing
    model = FakeLayers(clock, [0.010] * 32)
    _, reached = _layers_until(model, None, None, None, 0, 32, cutoff=100.001)
    assert model.calls == [(0, 1)] and reached == 1


def test_layers_that_take_no_measurable_time_still_stop_at_the_cutoff(clock):
    model = FakeLayers(clock, [0.0] * 8)
    _, reached = _layers_until(model, None, None, None, 0, 8, cutoff=99.0)
    assert model.calls == [(0, 1)] and reached == 1


def test_layers_slower_than_the_first_ones_are_judged_by_what_they_took(clock):
    # 10 ms a layer, then 40: after the (1, 3) call a layer is taken to cost 25 ms (that call's),
    # after (3, 5) 40 ms (not the 28 ms average), and no more fits
    model = FakeLayers(clock, [0.010, 0.010, 0.040, 0.040, 0.040, 0.040, 0.040, 0.040])
    _, reached = _layers_until(model, None, None, None, 0, 8, cutoff=100.150)
    assert model.calls == [(0, 1), (1, 3), (3, 5)]  # ends at 100.010, .060, .140
    assert reached == 5 and clock[0] <= 100.150


def test_past_the_cutoff_only_the_steps_first_split_chunk_runs_a_layer(clock):
    model = FakeLayers(clock, [0.010] * 8)
    first, second = _split_seq(False, False, layers=(2, 6)), _split_seq(False, False, layers=(4, 8))
    logits = run_forward(model, None, [first, second], [None, None], 8, cutoff=99.0)
    assert logits.shape[0] == 0
    assert model.calls == [(2, 3)]
    assert first.layers == (2, 3) and second.layers == (4, 4)  # the second goes on at layer 4 next step
    assert second.request.chunk_state == ("batch", 2)  # its hidden states untouched


def test_a_chunk_left_unstarted_by_the_cutoff_is_not_in_flight():
    scheduler = SimpleNamespace(num_layers=8)
    request = SimpleNamespace(chunk_tokens=0, chunk_layer=0)
    Scheduler.layers_run(scheduler, [ScheduledSeq(request, 300, 0, (0, 0), False)])
    assert (request.chunk_tokens, request.chunk_layer) == (0, 0)  # next step plans it afresh
    Scheduler.layers_run(scheduler, [ScheduledSeq(request, 300, 0, (0, 3), False)])
    assert (request.chunk_tokens, request.chunk_layer) == (300, 3)


def _split_seq(completes: bool, samples: bool, layers=(2, 8)) -> ScheduledSeq:
    request = SimpleNamespace(chunk_state=("batch", 2), num_computed_tokens=0,
                              num_tokens=100 if samples else 200)
    return ScheduledSeq(request, 100, 0, layers, completes)


@pytest.mark.parametrize("rows_fixed,samples,cut", [(False, True, True), (True, False, True), (True, True, False)])
def test_a_chunk_whose_logits_row_a_bitmask_counts_on_is_never_cut(clock, rows_fixed, samples, cut):
    model = FakeLayers(clock, [0.010] * 8)
    seq = _split_seq(completes=True, samples=samples)
    logits = _forward_split(model, None, seq, 8, None, cutoff=99.0, rows_fixed=rows_fixed)
    if cut:
        assert seq.layers == (2, 3) and not seq.completes and not seq.samples and logits is None
        assert seq.request.chunk_state[1] == 3  # its hidden states after layer 3 wait for the next step
    else:
        assert seq.layers == (2, 8) and seq.completes and logits is not None


def test_the_shape_after_a_cut_is_the_shape_of_the_layers_that_ran():
    def seq(n, computed, layers):
        return ScheduledSeq(SimpleNamespace(num_computed_tokens=computed, num_tokens=computed + n + 1), n,
                            0, layers, False)
    decode = ScheduledSeq(SimpleNamespace(num_computed_tokens=40, num_tokens=41), 1, 3)
    whole = ScheduledSeq(SimpleNamespace(num_computed_tokens=0, num_tokens=300), 200, 0)
    planned = [decode, whole, seq(512, 100, (2, 7))]
    ran = [decode, whole, seq(512, 100, (2, 4))]
    got, want = shape_after_cut(step_shape(planned, 8), ran[2], (2, 7), 8), step_shape(ran, 8)
    assert want.prefill_tokens < step_shape(planned, 8).prefill_tokens
    assert dataclasses.astuple(got) == pytest.approx(dataclasses.astuple(want))


def test_a_cutoff_past_the_bound_is_refused():
    with pytest.raises(ValueError, match="itl_cutoff"):
        SchedulerConfig(itl_cutoff=1.2)
    SchedulerConfig(itl_margin=0.95)  # above the default cutoff: the cutoff counts as the margin


class CheapPrefill(FakeCost):
    """Prefill predicted at 0.2 ms a token (a 512-token chunk: 12.8 ms a layer of 8), decode as
    FakeCost; the shapes it is told are kept."""

    def __init__(self):
        super().__init__()
        self.observed = []

    def prefill_seconds(self, tokens, ctx, frac=1.0):
        return 0.0002 * tokens * frac

    def observe(self, shape, seconds):
        self.observed.append(shape)


def run_traced(engine):
    """Step to idle; per step (planned layers, layers as they ran, the step's shape as planned,
    the shape the cost model was told, the scheduler's layer cutoff)."""
    steps, outs = [], {}
    while engine.has_unfinished_requests():
        planned = []
        out = spied_step(engine, outs, lambda o: planned.append((
            [(s.request.request_id, (s.layers, s.num_new_tokens)) for s in o.seqs],
            step_shape(o.seqs, engine.model.num_layers))))
        (layers, planned_shape), = planned
        steps.append((layers, [(s.request.request_id, s.layers) for s in out.seqs], planned_shape,
                      engine.step_cost.observed[-1], out.layer_cutoff_s))
        assert len(steps) < 500, "did not finish"
    return steps, outs


def test_a_step_slower_than_predicted_is_cut_short_and_later_steps_go_on(tiny, monkeypatch):
    """Layers take 20 ms each where the cost model says 12.8: a step planned to run 5 of them
    within 80 ms stops once the next would end past 90 ms; the chunk goes on from there, and the
    greedy output is the uncut run's."""
    alone = make_engine(tiny, itl_target_s=None)
    alone.add_request(prompt(600, seed=4), greedy(6), request_id="long")
    want = {}
    while alone.has_unfinished_requests():
        for out in alone.step():
            want.setdefault(out.request_id, []).extend(out.new_token_ids)

    busy = make_engine(tiny, itl_target_s=0.1)
    busy.step_cost = busy.scheduler.cost = CheapPrefill()
    start_decodes(busy, n=2, tokens=40)
    layers = type(tiny).forward_layers

    def slow(batch, kv_caches, h, start, stop):
        time.sleep(0.020 * (stop - start))
        return layers(tiny, batch, kv_caches, h, start, stop)
    monkeypatch.setattr(tiny, "forward_layers", slow)
    busy.add_request(prompt(600, seed=4), greedy(6), request_id="long")
    steps, got = run_traced(busy)

    L = tiny.num_layers
    pieces = [(*dict(planned)["long"], dict(ran)["long"], planned_shape, told, cutoff)
              for planned, ran, planned_shape, told, cutoff in steps if dict(planned).get("long", (None,))[0]]
    assert pieces, "the long prompt was never split by layers"
    cut = [(p, r) for p, _, r, _, _, _ in pieces if r[1] < p[1]]
    assert cut, pieces  # at least one step ran fewer layers than planned
    for p, chunk, r, planned_shape, told, cutoff in pieces:
        assert cutoff == pytest.approx(0.9 * 0.1)
        assert r[0] == p[0] and p[0] < r[1] <= p[1]  # at least one layer, never more than planned
        # the cost model was told the layers that ran, the decode rows as planned
        assert told.prefill_tokens == pytest.approx(planned_shape.prefill_tokens - chunk * (p[1] - r[1]) / L)
        assert (told.decode_rows, told.decode_ctx) == (planned_shape.decode_rows, planned_shape.decode_ctx)
    # each piece of a chunk starts where the one before it stopped, over every layer
    ran = [r for _, _, r, _, _, _ in pieces]
    for a, b in zip(ran, ran[1:]):
        assert b[0] == (0 if a[1] == tiny.num_layers else a[1])
    assert got["long"] == want["long"]
    busy.block_manager.check_invariants()
