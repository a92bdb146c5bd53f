"""Steps sized by time (issue 25): under a fake cost model, a step that carries prefill work
beside decodes stays within margin x the tightest ITL bound of the decoding requests (a chunk too
costly for it runs a few layers a step), a prefill always progresses, a prompt with nothing else
running gets whole chunks, a prompt is cut the same alone and under load (no short chunk on the other path), a
request's own `max_itl_s` tightens the budget with speculation off, drafts get only what a step
leaves when no prompt work waits beyond it (a grammar's forced tokens even then), waiting
prompts start
earliest TTFT deadline first, and greedy output is the same alone and under load, layer splits
included. Tests check the policy, never the machine's speed."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.step_cost import StepCostModel, step_shape


class FakeCost(StepCostModel):
    """A decode step costs 10 ms + 1 ms a row; a prompt token 1 ms through every layer; never refitted."""

    def decode_seconds(self, rows, ctx, forwards=0):
        return 0.010 + 0.001 * rows

    def prefill_seconds(self, tokens, ctx, frac=1.0):
        return 0.001 * tokens * frac

    def observe(self, shape, seconds):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("long") / "tiny", max_position_embeddings=2048, num_hidden_layers=8)
    ckpt = load_checkpoint(str(path))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def make_engine(model, **scheduler) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=512),
                          scheduler=SchedulerConfig(**{"max_num_batched_tokens": 512, **scheduler}))
    engine = Engine(model, None, config, eos_token_ids=(2,))
    engine.step_cost = engine.scheduler.cost = FakeCost()
    return engine


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (n,), generator=g).tolist()


def spied_step(engine, outs: dict, at_schedule=None):
    """One engine step; returns its SchedulerOutput (`at_schedule(out)` runs as the scheduler
    returns it, before the forward) and adds the step's tokens to `outs` by request id."""
    schedule, got = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        got.append(out)
        if at_schedule is not None:
            at_schedule(out)
        return out
    engine.scheduler.schedule = spy
    try:
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        engine.scheduler.schedule = schedule
    return got[0]


def trace(engine, max_steps=2000):
    """Step to idle; per step the scheduled seqs' (id, tokens, layers) and its predicted cost."""
    steps, outs = [], {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return steps, outs
        sched_seqs = spied_step(engine, outs).seqs
        decoding = [s for s in sched_seqs if s.num_new_tokens == 1]
        steps.append(([(s.request.request_id, s.num_new_tokens, s.layers) for s in sched_seqs],
                      engine.step_cost.predict(step_shape(sched_seqs, engine.model.num_layers)), len(decoding)))
    raise AssertionError("did not finish")


def start_decodes(engine, n=2, tokens=60, **kw):
    for i in range(n):
        engine.add_request(prompt(20, seed=10 + i), greedy(tokens, **kw), request_id=f"d{i}")
    while any(not engine.requests[f"d{i}"].output_token_ids for i in range(n)):
        engine.step()


def test_prefill_beside_decodes_stays_within_the_itl_budget_and_always_progresses(tiny):
    engine = make_engine(tiny, itl_target_s=0.1, itl_margin=0.85)
    start_decodes(engine)
    engine.add_request(prompt(700, seed=1), greedy(4), request_id="long")
    steps, outs = trace(engine)
    with_prefill = [(seqs, cost, nd) for seqs, cost, nd in steps if any(r == "long" and n > 1 for r, n, _ in seqs)]
    assert with_prefill, "the long prompt never ran"
    for seqs, cost, n_decoding in with_prefill:
        if n_decoding:
            assert cost <= 0.085 + 1e-9, (seqs, cost)  # 1 ms/token: a 512-token chunk alone is over it
    assert any(layers is not None for seqs, _, _ in with_prefill for r, _, layers in seqs if r == "long")
    assert len(outs["long"]) == 4  # it finished


def test_alone_a_prompt_gets_whole_budget_chunks(tiny):
    engine = make_engine(tiny, itl_target_s=0.1)
    engine.add_request(prompt(1100, seed=2), greedy(2), request_id="long")
    steps, _ = trace(engine)
    chunks = [n for seqs, _, _ in steps for r, n, layers in seqs if r == "long" and n > 1]
    assert chunks[0] == 512 and sum(chunks) == 1100
    assert all(layers is None for seqs, _, _ in steps for _, _, layers in seqs)


@pytest.mark.parametrize("length", [530, 700, 1100])
def test_a_prompt_is_cut_the_same_alone_and_under_load(tiny, length):
    """A prompt's chunks are set by its own length: the same cuts with nothing else running and
    beside decodes (where the time budget splits them by layers instead), none of 64 tokens or
    fewer (no prompt row on the other path)."""
    cuts = {}
    for load in (False, True):
        engine = make_engine(tiny, itl_target_s=0.1, prefill_chunk=256)
        if load:
            start_decodes(engine)
        engine.add_request(prompt(length, seed=3), greedy(2), request_id="p")
        steps, _ = trace(engine)
        cuts[load] = [n for seqs, _, _ in steps for r, n, layers in seqs
                      if r == "p" and n > 1 and (layers is None or layers[0] == 0)]
        assert sum(cuts[load]) == length
        assert all(c > 64 for c in cuts[load]), cuts[load]
        assert all(c == 256 for c in cuts[load][:-1]), cuts[load]
    assert cuts[True] == cuts[False]


def test_greedy_output_is_the_same_alone_and_under_load_with_layer_splits(tiny):
    alone = make_engine(tiny, itl_target_s=None)
    alone.add_request(prompt(600, seed=4), greedy(12), request_id="long")
    _, want = trace(alone)
    busy = make_engine(tiny, itl_target_s=0.02)  # tight: the 512-token chunks run a layer a step
    start_decodes(busy, n=3)
    busy.add_request(prompt(600, seed=4), greedy(12), request_id="long")
    steps, got = trace(busy)
    assert any(layers is not None for seqs, _, _ in steps for r, _, layers in seqs if r == "long")
    assert got["long"] == want["long"]
    busy.block_manager.check_invariants()


def test_a_requests_own_itl_bound_tightens_the_budget_with_speculation_off(tiny):
    def prefill_per_step(**kw):
        engine = make_engine(tiny, itl_target_s=0.2)
        start_decodes(engine, n=1, **kw)
        engine.add_request(prompt(700, seed=5), greedy(2), request_id="long")
        steps, _ = trace(engine)
        per = []
        for seqs, _, nd in steps:
            for r, n, layers in seqs:
                if r == "long" and n > 1 and nd:
                    per.append(n * ((layers[1] - layers[0]) / tiny.num_layers if layers else 1))
        return max(per)

    loose = prefill_per_step()
    tight = prefill_per_step(speculate=False, max_itl_s=0.05)
    assert tight < loose


def test_draft_slots_are_what_the_itl_budget_leaves_after_every_decode(tiny):
    """Eight decodes each wanting a 40-node draft tree: the step's rows are capped by time
    (FakeCost: 10 ms + 1 ms a row within 0.8 x 100 ms, so 70 rows), every decode keeps its own
    row, and the drafts share what is left."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=1024)
    start_decodes(engine, n=8, tokens=20)
    for request in engine.scheduler.running:
        request.spec_budget = 40
    out = engine.scheduler.schedule()
    decodes = [s for s in out.seqs if s.num_new_tokens == 1]
    assert len(decodes) == 8
    rows = sum(1 + s.num_spec_slots for s in decodes)
    assert rows == 70 and engine.step_cost.decode_seconds(rows, 0) <= 0.08 + 1e-9
    assert decodes[0].num_spec_slots == 40  # oldest first, as the token budget is shared
    loose = make_engine(tiny, itl_target_s=None, max_num_batched_tokens=1024)
    start_decodes(loose, n=8, tokens=20)
    for request in loose.scheduler.running:
        request.spec_budget = 40
    assert sum(s.num_spec_slots for s in loose.scheduler.schedule().seqs) == 8 * 40  # no bound: no cap


class CtxCost(FakeCost):
    """FakeCost with attention: a small forward's row costs 1 ms + 4 ms per 1000 positions of
    its context; a prompt token in a large forward 0.5 ms."""

    def decode_seconds(self, rows, ctx, forwards=0):
        return 0.010 + 0.001 * rows + 0.004 * rows * ctx / 1000

    def prefill_seconds(self, tokens, ctx, frac=1.0):
        return 0.0005 * tokens * frac


def test_each_draft_is_priced_at_its_own_requests_context(tiny):
    """Drafts go to the oldest requests first, which here hold the longest contexts. Priced at
    the decodes' mean context, their rows would take the step past its budget; priced each at
    its own request's context, the step's prediction stays within 0.8 x 100 ms and the drafts
    still get what is left."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=2048)
    engine.step_cost = engine.scheduler.cost = CtxCost()
    for i in range(2):
        engine.add_request(prompt(1500, seed=30 + i), greedy(40), request_id=f"long{i}")
    for i in range(6):
        engine.add_request(prompt(20, seed=40 + i), greedy(40), request_id=f"short{i}")
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for request in engine.scheduler.running:
        request.spec_budget = 40
    out = engine.scheduler.schedule()
    assert len(out.seqs) == 8 and all(s.num_new_tokens == 1 for s in out.seqs)
    drafts = {s.request.request_id: s.num_spec_slots for s in out.seqs}
    assert drafts["long0"] > 0  # oldest first
    assert engine.step_cost.predict(step_shape(out.seqs, tiny.num_layers)) <= 0.08 + 1e-9
    # and no more than fit: one more draft row for the first request left short would not
    short = next(s for s in out.seqs if s.num_spec_slots < 40)
    more = [dataclasses.replace(s, num_spec_slots=s.num_spec_slots + (s is short)) for s in out.seqs]
    assert engine.step_cost.predict(step_shape(more, tiny.num_layers)) > 0.08


class PackCost(FakeCost):
    """A small forward costs 25 ms (a pass over the weights), a row 0.2 ms; `forwards` as the
    forward plan packs the rows (default: ceil(rows / 64))."""

    def decode_seconds(self, rows, ctx, forwards=0):
        return 0.025 * (forwards or max(1, -(-rows // 64))) + 0.0002 * rows


def test_draft_rows_are_priced_with_the_forwards_the_plan_packs_them_into(tiny):
    """A sequence never spans two small forwards, so three 33-row trees take three forwards
    where their 99 rows would fit two. The third decode's drafts stop where its tree still
    packs into the second forward (3 x 25 ms would pass the 80 ms budget; ceil(99 / 64) = 2
    forwards would not have)."""
    from prescient.runtime.step_cost import packed_forwards

    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=1024)
    engine.step_cost = engine.scheduler.cost = PackCost()
    start_decodes(engine, n=3, tokens=20)
    for request in engine.scheduler.running:
        request.spec_budget = 32
    out = engine.scheduler.schedule()
    assert [s.num_spec_slots for s in out.seqs] == [32, 32, 30]
    rows = [1 + s.num_spec_slots for s in out.seqs]
    assert packed_forwards(rows) == 2
    assert engine.step_cost.predict(step_shape(out.seqs, tiny.num_layers)) <= 0.08 + 1e-9


def test_packed_forwards_counts_the_forward_plans_small_forwards():
    """step_shape's count of small forwards is the forward plan's (runtime/forward_plan.plan):
    sequences packed in order, a new forward when the next does not fit, more than 64 rows
    alone."""
    from types import SimpleNamespace

    from prescient.runtime.forward_plan import plan
    from prescient.runtime.step_cost import packed_forwards

    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        rows = [int(torch.randint(1, 90, (1,), generator=g)) for _ in range(n)]
        seqs = [SimpleNamespace(num_new_tokens=r, layers=None, logits=None) for r in rows]
        assert packed_forwards(rows) == len(plan(seqs, [None] * n)), rows


def test_the_decode_price_never_falls_as_rows_are_added():
    """The scheduler's searches assume more rows cost more. A fit of a flat stretch can slope
    down, or put the intercept below zero; the prices still grow with the rows."""
    model = StepCostModel()
    for theta in ([0.01, -0.001, 0.0], [-0.005, 0.001, 0.0], [0.004, 0.0005, -0.002]):
        model.decode.theta = list(theta)
        prices = [model.decode_seconds(rows, 800.0) for rows in range(0, 200)]
        assert all(b >= a for a, b in zip(prices, prices[1:])), theta
        assert model.decode_seconds(65, 800.0) > model.decode_seconds(64, 800.0)




def test_a_short_prompt_is_priced_as_the_rows_it_adds_to_the_small_forwards(tiny):
    """A prompt of at most 64 tokens runs among the decode rows, and the step's prediction
    prices it so; the plan prices it the same way. Here such a row costs twice a large
    forward's prompt token: two 40-token prompts would fit the slack at the large forward's
    price, only one at the rows' price. One starts (a step's first prefill work always
    progresses), the other waits for the next step, and the step stays within its budget."""
    engine = make_engine(tiny, itl_target_s=0.1)
    engine.step_cost = engine.scheduler.cost = CtxCost()
    start_decodes(engine, n=2, tokens=20)
    engine.add_request(prompt(40, seed=50), greedy(2), request_id="a")
    engine.add_request(prompt(40, seed=51), greedy(2), request_id="b")
    out = engine.scheduler.schedule()
    started = [s.request.request_id for s in out.seqs if s.num_new_tokens > 1]
    assert started == ["a"] and [r.request_id for r in engine.scheduler.waiting] == ["b"]
    assert engine.step_cost.predict(step_shape(out.seqs, tiny.num_layers)) <= 0.08 + 1e-9


def _first_step(tiny, spec_budget, prompt_tokens):
    """The first step after a prompt of `prompt_tokens` arrives beside two decodes that each
    want `spec_budget` draft slots: the prompt's (tokens, layers), the draft slots granted, and
    the step's predicted cost."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=1024)  # time, not tokens, binds
    start_decodes(engine, n=2, tokens=20)
    engine.add_request(prompt(prompt_tokens, seed=21), greedy(2), request_id="p")
    for request in engine.scheduler.running:
        request.spec_budget = spec_budget
    out = engine.scheduler.schedule()
    work = [(s.num_new_tokens, s.layers) for s in out.seqs if s.request.request_id == "p"]
    drafts = sum(s.num_spec_slots for s in out.seqs)
    return work, drafts, engine.step_cost.predict(step_shape(out.seqs, tiny.num_layers))


def test_no_drafts_while_prompt_work_waits_beyond_the_step(tiny):
    """A 700-token prompt cannot finish in one step beside decodes (its 512-token chunk runs a
    few layers): the step carries no drafts, however many the decodes want -- the time left
    after the prompt's layers would lengthen the step, and the prompt's next layers wait for the
    next step. The prompt advances exactly as with no drafts wanted."""
    plain, no_drafts, _ = _first_step(tiny, 0, 700)
    wanting, drafts, cost = _first_step(tiny, 40, 700)
    assert plain and plain[0][1] is not None  # split by layers: work is left for later steps
    assert wanting == plain and no_drafts == 0 and drafts == 0
    assert cost <= 0.08 + 1e-9


def test_drafts_take_what_a_finished_prompt_leaves_of_the_bound(tiny):
    """A 40-token prompt finishes in this step (one chunk, all layers): nothing waits beyond it,
    so the drafts get what it leaves of the ITL budget -- some, not all they want -- and the
    prompt advances as with no drafts wanted."""
    plain, _, _ = _first_step(tiny, 0, 40)
    wanting, drafts, cost = _first_step(tiny, 40, 40)
    assert plain == [(40, None)] and wanting == plain
    assert 0 < drafts < 2 * 40 and cost <= 0.08 + 1e-9


def test_a_prompt_waiting_only_for_a_seat_does_not_stop_the_drafts(tiny):
    """A prompt left waiting by the sequence limit, not by the step's time, waits on the running
    streams: they keep their drafts (which finish them sooner). Beside a prompt left waiting for
    time they get none (above)."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_seqs=2)
    start_decodes(engine, n=2, tokens=20)
    engine.add_request(prompt(30, seed=12), greedy(2), request_id="w")
    for request in engine.scheduler.running:
        request.spec_budget = 4
    out = engine.scheduler.schedule()
    assert [s.request.request_id for s in out.seqs] == ["d0", "d1"] and engine.scheduler.waiting
    assert [s.num_spec_slots for s in out.seqs] == [4, 4]


def test_a_prompt_left_waiting_for_time_stops_the_drafts(tiny):
    """Two prompts beside the decodes: the first takes the step's slack (a layer of its chunk),
    the second is left waiting for time, and the decodes get no drafts."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=1024)
    start_decodes(engine, n=2, tokens=20)
    engine.add_request(prompt(700, seed=21), greedy(2), request_id="p")
    engine.add_request(prompt(700, seed=22), greedy(2), request_id="q")
    for request in engine.scheduler.running:
        request.spec_budget = 40
    out = engine.scheduler.schedule()
    assert [s.request.request_id for s in out.seqs] == ["d0", "d1", "p"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["q"]
    assert sum(s.num_spec_slots for s in out.seqs) == 0


def test_grammar_forced_tokens_still_go_while_prompt_work_waits(tiny):
    """Beside a prompt the step cannot finish, a decode keeps only the slots for the tokens its
    grammar forces next (the speculator's `forced_budget`: accepted for certain, rows the stream
    needs anyway), within the time left; a decode with nothing forced gets none."""
    engine = make_engine(tiny, itl_target_s=0.1, max_num_batched_tokens=1024)
    start_decodes(engine, n=2, tokens=20)
    engine.add_request(prompt(700, seed=21), greedy(2), request_id="p")
    d0, d1 = engine.scheduler.running
    d0.spec_budget, d0.forced_budget = 40, 3
    d1.spec_budget, d1.forced_budget = 40, 0
    out = engine.scheduler.schedule()
    slots = {s.request.request_id: s.num_spec_slots for s in out.seqs if s.num_new_tokens == 1}
    assert slots == {"d0": 3, "d1": 0}
    assert engine.step_cost.predict(step_shape(out.seqs, tiny.num_layers)) <= 0.08 + 1e-9


def first_tokens_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    return order


def test_waiting_prompts_start_earliest_ttft_deadline_first(tiny):
    engine = make_engine(tiny, itl_target_s=None, max_num_seqs=1)
    engine.add_request(prompt(20, seed=6), greedy(30), request_id="busy")
    engine.step()
    engine.add_request(prompt(20, seed=7), greedy(2, max_ttft_s=60.0), request_id="relaxed")
    engine.add_request(prompt(20, seed=8), greedy(2, max_ttft_s=30.0), request_id="urgent")
    order = first_tokens_order(engine)
    assert order.index("urgent") < order.index("relaxed")


def test_a_prompt_already_late_yields_to_one_on_time_but_not_without_bound(tiny):
    """Under overload, serving a prompt past its deadline first saves nobody: on-time prompts go
    first. One more than 5 s late goes before everyone (none starves)."""
    import time

    def order(late_by_s):
        engine = make_engine(tiny, itl_target_s=None, max_num_seqs=1)
        engine.add_request(prompt(20, seed=6), greedy(30), request_id="busy")
        engine.step()
        # due 1 s after its arrival (the default bound), which was late_by_s + 1 s ago
        engine.add_request(prompt(20, seed=7), greedy(2), request_id="late",
                           arrival_time=time.perf_counter() - 1.0 - late_by_s)
        engine.add_request(prompt(20, seed=8), greedy(2, max_ttft_s=60.0), request_id="on-time")
        return first_tokens_order(engine)

    assert order(2.0).index("on-time") < order(2.0).index("late")
    assert order(10.0).index("late") < order(10.0).index("on-time")  # (30 s would expire it)


def test_a_short_prompt_goes_before_a_long_one_that_cannot_make_its_bound(tiny):
    """A 1500-token prompt (1.5 s alone here: past the 1 s TTFT bound, so due at 1.3x that) has
    started; a short one arriving next starts before the long one's next chunk (the chunk in
    flight by layers finishes first)."""
    engine = make_engine(tiny, itl_target_s=0.1)
    start_decodes(engine, n=2, tokens=200)
    engine.add_request(prompt(1500, seed=12), greedy(2), request_id="long")
    for _ in range(3):
        engine.step()
    assert engine.requests["long"].num_computed_tokens < 1500  # still prefilling
    # the short one arrives 50 ms after the long one, however long these steps took on this
    # machine (deadlines are wall-clock: on a loaded host the long one's could come first)
    engine.requests["long"].arrival_time = time.perf_counter() - 0.05
    engine.add_request(prompt(30, seed=13), greedy(2), request_id="short")
    steps, _ = trace(engine)
    order = [(r, layers) for seqs, _, _ in steps for r, n, layers in seqs if r in ("long", "short") and n > 1]
    first_short = next(i for i, (r, _) in enumerate(order) if r == "short")
    new_long_chunks = [i for i, (r, layers) in enumerate(order) if r == "long" and (layers is None or layers[0] == 0)]
    assert new_long_chunks and first_short < new_long_chunks[0]


def test_the_cost_model_learns_this_machine_from_its_own_steps():
    """Refitted from measured steps, starting from priors 3x off, it predicts within 10% after
    a few dozen steps, and an outlier step moves it only boundedly."""
    from prescient.runtime.step_cost import StepShape

    def truth(s: StepShape) -> float:  # 6 ms + 0.5 ms a row; 6 ms a prompt token + ctx term
        return (0.006 + 0.0005 * s.decode_rows + 0.00002 * s.decode_rows * s.decode_ctx / 1000
                + s.prefill_tokens * (0.006 + 0.002 * s.prefill_ctx / 1000))

    model = StepCostModel()
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        rows = int(torch.randint(1, 9, (1,), generator=g))
        ctx = float(torch.randint(100, 2000, (1,), generator=g))
        decode = StepShape(rows, ctx)
        model.observe(decode, truth(decode))
        tokens = float(torch.randint(4, 40, (1,), generator=g))
        mixed = StepShape(rows, ctx, tokens, ctx)
        model.observe(mixed, truth(mixed))
    for shape in (StepShape(4, 800), StepShape(2, 500, 32, 900), StepShape(8, 1500, 10, 1500)):
        assert abs(model.predict(shape) / truth(shape) - 1) < 0.1, shape
    before = model.predict(StepShape(4, 800))
    model.observe(StepShape(4, 800), 5.0)  # a 5 s hiccup
    assert model.predict(StepShape(4, 800)) < 4 * before


def test_the_cost_model_prices_each_small_forward_as_another_pass_over_the_weights():
    """Rows past BATCH_INVARIANT_M take a second small forward, which reads the weights again:
    the fitted model shows that step up rather than spreading it over every row."""
    from prescient.runtime.linear import BATCH_INVARIANT_M as M
    from prescient.runtime.step_cost import StepShape

    def truth(s: StepShape) -> float:  # 8 ms a forward, 0.6 ms a row
        return 0.008 * max(1, -(-s.decode_rows // M)) + 0.0006 * s.decode_rows + 0.0001 * s.decode_rows * s.decode_ctx / 1000

    model = StepCostModel()
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        shape = StepShape(int(torch.randint(1, 2 * M + 1, (1,), generator=g)), float(torch.randint(50, 1500, (1,), generator=g)))
        model.observe(shape, truth(shape))
    for rows in (1, M // 2, M, M + 1, 2 * M):  # (the priors' ridge keeps a little pull)
        shape = StepShape(rows, 500.0)
        assert abs(model.predict(shape) / truth(shape) - 1) < 0.15, rows
    step_up = model.predict(StepShape(M + 1, 500.0)) - model.predict(StepShape(M, 500.0))
    assert step_up > 0.006


def test_recursive_least_squares_is_the_weighted_least_squares_solution():
    """After T samples, theta is the closed form's: the minimiser of sum_t lambda^(T-t)
    (y_t - x_t . theta)^2 + (theta - prior)' P0^-1 (theta - prior) (the prior a ridge that is
    never forgotten), and R that form's Hessian / 2."""
    import numpy as np

    from prescient.runtime.step_cost import RecursiveLeastSquares

    prior, scales, lam = [0.004, 0.001, 0.0002], [1.0, 0.25, 0.01], 0.95
    rls = RecursiveLeastSquares(prior, prior_scale=scales, forgetting=lam)
    rng = np.random.default_rng(0)
    xs = np.column_stack([np.ones(25), rng.integers(1, 9, 25), rng.uniform(0.1, 2.0, 25)])
    ys = xs @ np.array([0.006, 0.0005, 0.0002]) + rng.normal(0, 1e-4, 25)
    for x, y in zip(xs, ys):
        rls.update(x.tolist(), float(y))
    T = len(ys)
    w = lam ** np.arange(T - 1, -1, -1)
    info = np.diag(1 / np.array(scales)) + (xs * w[:, None]).T @ xs
    theta = np.linalg.solve(info, np.array(prior) / np.array(scales) + (xs * w[:, None]).T @ ys)
    assert np.allclose(rls.theta, theta, rtol=1e-8, atol=1e-12)
    assert np.allclose(rls.R, info, rtol=1e-8, atol=1e-12)
    assert rls.num_samples == T
    assert abs(rls.predict([1.0, 4.0, 0.8]) - float(np.array([1.0, 4.0, 0.8]) @ theta)) < 1e-12
    rls.update([1.0, float("inf"), 0.0], 1.0)  # degenerate: skipped, nothing poisoned
    rls.update([1.0, 2.0, 0.0], float("nan"))
    assert rls.num_samples == T and np.allclose(rls.theta, theta, rtol=1e-8, atol=1e-12)
    with pytest.raises(ValueError, match="features"):
        rls.update([1.0, 2.0], 1.0)


def test_a_long_run_of_one_shape_leaves_the_other_shapes_priced_sanely():
    """A server's first minutes may see only one-row decode steps (one agent at a time), then
    eight agents at once. The one-row phase teaches the sum of the intercept and the per-row
    cost, nothing about either alone; afterwards the first multi-row steps must be priced near
    their cost, and a few of them must put the fit right. (With plain forgetting the unexcited
    direction's covariance wound up and the fit swung by orders of magnitude, as measured
    under `bench load`.)"""
    from prescient.runtime.step_cost import StepShape

    def truth(s: StepShape) -> float:  # a memory-bound step: 5 ms, then 0.8 ms a row, ctx term
        return 0.005 + 0.0008 * s.decode_rows + 0.00005 * s.decode_rows * s.decode_ctx / 1000

    model = StepCostModel()
    g = torch.Generator().manual_seed(1)
    for i in range(3000):  # ~15 s of one-row steps, context growing and resetting per request
        shape = StepShape(1, 100.0 + (i % 300))
        noise = 1 + 0.05 * float(torch.randn(1, generator=g))
        model.observe(shape, truth(shape) * noise)
    for rows in (1, 4, 8, 32, 100):
        shape = StepShape(rows, 300.0)
        assert 0.5 < model.predict(shape) / truth(shape) < 2.0, (rows, model.predict(shape), truth(shape))
    for i in range(30):  # eight agents: mixed row counts
        shape = StepShape(int(torch.randint(4, 80, (1,), generator=g)), 300.0)
        model.observe(shape, truth(shape))
    for rows in (1, 4, 8, 32, 100):
        shape = StepShape(rows, 300.0)
        assert abs(model.predict(shape) / truth(shape) - 1) < 0.15, rows


def test_bounds_the_server_cannot_meet_even_alone_are_reported(tiny):
    engine = make_engine(tiny, itl_target_s=0.1)
    # FakeCost: one decode step is 11 ms, a 300-token prompt 300 ms
    engine.add_request(prompt(300, seed=9), greedy(3, max_itl_s=0.005, max_ttft_s=0.05), request_id="strict")
    engine.add_request(prompt(300, seed=9), greedy(3, max_itl_s=0.5, max_ttft_s=5.0), request_id="easy")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    notes = finals["strict"].slo_notes
    assert notes and any(n.startswith("itl_ms 5") for n in notes) and any(n.startswith("ttft_ms 50") for n in notes)
    assert finals["easy"].slo_notes is None
