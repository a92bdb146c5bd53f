"""Adaptive speculation: the cost model, the plan's optimality, and how budgets follow acceptance."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation, expected_tokens
from prescient.speculative.verify import BONUS, RECOVERED, VerifyOutcome
from prescient.speculative.verify_cost import CostModel


def outcome(num_draft: int, num_accepted: int) -> VerifyOutcome:
    nodes = tuple(range(num_accepted + 1))
    role = BONUS if num_accepted == num_draft else RECOVERED
    return VerifyOutcome(nodes, tuple(range(num_accepted)), 0, role, num_draft)


@pytest.mark.parametrize(
    "num_tokens, cost",
    [(1, 1.0), (2, 1.0 + 0.1 / 3), (4, 1.1), (6, 1.175), (8, 1.25), (12, 1.375), (16, 1.5),
     (32, 2.0)],  # past the table: the last segment's slope (0.25 / 8 per token)
)
def test_cost_model_interpolates_and_extrapolates(num_tokens, cost):
    assert CostModel({1: 1.0, 4: 1.1, 8: 1.25, 16: 1.5})(num_tokens) == pytest.approx(cost)


def test_cost_model_edge_tables():
    assert CostModel({1: 1.0})(50) == 1.0
    with pytest.raises(ValueError):
        CostModel({})
    with pytest.raises(ValueError):
        CostModel({0: 1.0, 4: 1.1})
    with pytest.raises(ValueError):
        AdaptiveConfig(verify_cost={1: -1.0, 2: 1.0})


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5.0


def _objective(rates, budgets, cost, num_base):
    value = sum(expected_tokens(r, k) for r, k in zip(rates, budgets))
    return value / cost(num_base + sum(budgets))


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_the_exact_optimum(seed):
    rng = random.Random(seed)
    table = {1: 1.0, 2: 1.02, 4: 1.1, 6: 1.3, 8: 1.35, 12: 1.9}  # deliberately not convex
    controller = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=4, verify_cost=table))
    ids = ["a", "b", "c"]
    for request_id in ids:
        for _ in range(5):  # drive each estimate somewhere different
            k = rng.randrange(1, 5)
            controller.observe(request_id, outcome(k, rng.randrange(k + 1)))
    rates = [controller.acceptance_rate(r) for r in ids]
    num_base = rng.randrange(3, 6)
    budgets = controller.plan(ids, num_base_tokens=num_base)
    best = max(_objective(rates, b, controller.verify_cost, num_base)
               for b in itertools.product(range(5), repeat=3))
    assert _objective(rates, budgets, controller.verify_cost, num_base) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(4))
def test_lone_request_plan_equals_the_batch_scan(seed):
    """plan's float path for one request (_plan_one) gives the numpy scan's budget (_plan_many):
    random estimates, tables (with a long-context one), draft costs and ITL caps."""
    rng = random.Random(seed)
    for _ in range(60):
        table = {1: 1.0, **{k: 1.0 + rng.random() * k / 4 for k in (2, 4, 8, 16)}}
        long = {1: 1.0, **{k: 1.0 + rng.random() * k / 3 for k in (2, 4, 8, 16)}}
        lone = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=rng.choice([4, 8, 16])))
        lone.set_verify_cost(table, (256, 1024, long) if rng.random() < 0.5 else None)
        lone.set_draft_cost(rng.choice([0.0, 0.05, 0.3]))
        for _ in range(rng.randrange(6)):
            k = rng.randrange(1, 9)
            lone.observe("r", outcome(k, rng.randrange(k + 1)))
        context, num_base = rng.choice([None, 100, 600, 3000]), rng.randrange(1, 4)
        costs = lone.cost_many(num_base + np.arange(lone.config.max_draft_tokens + 1), context)
        allowed = rng.choice([float("inf"), float(costs[rng.randrange(len(costs))])])
        assert lone._plan_one("r", num_base, context, allowed) == lone._plan_many(["r"], num_base, context, allowed)[0]
        for n in (1, 2, 5, 16, 40):
            assert lone.cost(n, context) == float(lone.cost_many(np.array([n]), context)[0])


def test_new_cost_tables_replace_the_lone_plans_costs():
    """_plan_one reads the tables' costs once per count: new tables (a recalibration) are what
    the next plan reads."""
    lone = AdaptiveSpeculation()
    lone.set_verify_cost({1: 1.0, 16: 1.1})  # drafts nearly free: several
    cheap = lone.plan(["r"])[0]
    assert cheap > 2 and cheap == lone._plan_many(["r"], 1, None, float("inf"))[0]
    lone.set_verify_cost({1: 1.0, 2: 3.0, 16: 40.0})  # every draft costs more than it can give
    assert lone.plan(["r"]) == [0] == lone._plan_many(["r"], 1, None, float("inf"))
    lone.set_verify_cost({1: 1.0, 16: 1.1}, (256, 1024, {1: 1.0, 2: 3.0, 16: 40.0}))
    assert lone.plan(["r"], context=256) == [cheap] and lone.plan(["r"], context=1024) == [0]


def test_fresh_request_gets_the_prior_plan():
    # prior acceptance 0.5, default costs: 3 drafts maximise (1 + .5 + .25 + .125) / cost(4)
    assert AdaptiveSpeculation().plan(["r"]) == [3]


def test_budget_follows_acceptance():
    controller = AdaptiveSpeculation()
    for _ in range(20):
        budget = controller.plan(["r"])[0]
        controller.observe("r", outcome(budget, budget))  # everything accepted
    assert controller.acceptance_rate("r") > 0.99
    assert controller.plan(["r"]) == [16]  # the cap
    assert controller.mean_accepted("r") > 10
    for _ in range(20):
        budget = controller.plan(["r"])[0]
        if budget:
            controller.observe("r", outcome(budget, 0))  # everything rejected
    assert controller.acceptance_rate("r") < 0.05
    assert controller.plan(["r"]) == [0]


def test_persistent_rejection_stops_then_probes_and_recovers():
    config = AdaptiveConfig(probe_interval=4, probe_tokens=2)
    controller = AdaptiveSpeculation(config)
    for _ in range(10):
        controller.observe("r", outcome(4, 0))
    plans = [controller.plan(["r"])[0] for _ in range(10)]
    assert plans == [0, 0, 0, 0, 2, 0, 0, 0, 0, 2]
    for _ in range(6):  # the text turned copyable: probes succeed, the estimate climbs back
        budget = max(controller.plan(["r"])[0], 1)
        controller.observe("r", outcome(budget, budget))
    assert controller.plan(["r"])[0] >= 3


def test_large_batches_stop_speculating():
    controller = AdaptiveSpeculation()
    ids = [f"r{i}" for i in range(64)]
    assert sum(controller.plan(ids[:1])) == 3
    assert sum(controller.plan(ids)) == 0  # at 0.5 acceptance a draft no longer pays at batch 64
    # measured costs that stay flat (a GPU far from its compute limit): speculation pays again
    controller.set_verify_cost({1: 1.0, 4096: 1.0})
    assert controller.plan(ids) == [16] * 64


def test_prefill_tokens_in_the_batch_count_toward_cost():
    # Tokens are free up to 8 per forward, then each costs as much as a whole step.
    controller = AdaptiveSpeculation(AdaptiveConfig(verify_cost={1: 1.0, 8: 1.0, 9: 2.0}))
    assert controller.plan(["r"], num_base_tokens=1) == [7]  # fill the free slots
    assert controller.plan(["r"], num_base_tokens=8) == [0]  # a prefill chunk already filled them


def test_steps_without_drafts_are_ignored_and_forget_resets():
    controller = AdaptiveSpeculation()
    controller.observe("r", outcome(0, 0))
    assert controller.acceptance_rate("r") == 0.5
    controller.observe("r", outcome(3, 0))
    assert controller.acceptance_rate("r") < 0.5
    controller.forget("r")
    assert controller.acceptance_rate("r") == 0.5


def test_forced_span_is_not_judged_as_drafts():
    """A grammar-forced span is accepted by construction: the estimate judges the drafts below it."""
    controller = AdaptiveSpeculation()
    for _ in range(5):
        controller.observe("span", outcome(4, 4), forced=4)  # only the span: no information
    assert controller.acceptance_rate("span") == 0.5
    for _ in range(5):
        controller.observe("tail", outcome(6, 4), forced=4)  # span accepted, both drafts below rejected
    same = AdaptiveSpeculation()
    for _ in range(5):
        same.observe("tail", outcome(2, 0))  # what the drafts alone say
    assert controller.acceptance_rate("tail") == pytest.approx(same.acceptance_rate("tail"))
    assert controller.acceptance_rate("tail") < 0.2  # counting the span in, it would near 4 / 5
    assert controller.mean_accepted("tail") == pytest.approx(same.mean_accepted("tail"))


@pytest.mark.parametrize(
    "overrides", [dict(max_draft_tokens=-1), dict(ema_decay=1.0), dict(prior_acceptance=1.5), dict(probe_interval=0)]
)
def test_config_validation(overrides):
    with pytest.raises(ValueError):
        AdaptiveConfig(**overrides)


def test_long_context_cost_shrinks_drafts():
    """With a steeper cost table measured at a long context, a request deep into a long context
    gets fewer drafts than the same request at a short one; the interpolation is linear."""
    controller = AdaptiveSpeculation()
    controller.set_verify_cost({1: 1.0, 4: 1.05, 16: 1.3}, (256, 1024, {1: 1.0, 4: 1.4, 16: 3.0}))
    for _ in range(10):
        controller.observe("r", outcome(4, 3))
    short, long = controller.plan(["r"], context=200)[0], controller.plan(["r"], context=1500)[0]
    assert short > long
    assert controller.plan(["r"])[0] == short  # no context: the short-context table
    mid = controller.cost_many(np.array([4]), context=640)[0]
    assert mid == pytest.approx(1.05 + 0.5 * (1.4 - 1.05))
    # no extrapolation past the measured contexts: a long table that came out cheaper (timing
    # noise) must not drive costs below 1 far out
    controller.set_verify_cost({1: 1.0, 16: 2.0}, (256, 1024, {1: 1.0, 16: 1.5}))
    far = controller.cost_many(np.array([1, 8, 16]), context=100_000)
    assert far.tolist() == pytest.approx(controller.cost_many(np.array([1, 8, 16]), context=1024).tolist())
    assert (far >= 1.0).all()


def test_drafting_that_costs_more_than_it_gains_is_planned_away():
    """The planner prices drafting per request that drafts: at acceptance 0.5 a draft pays on a
    flat verify cost when drafting is free, and not once drafting costs a whole step."""
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=4, prior_acceptance=0.5,
                                                  verify_cost={1: 1.0, 64: 1.0}))
    assert adaptive.plan(["a"]) == [4]
    adaptive.set_draft_cost(1.0)
    assert adaptive.plan(["a"]) == [0]
    adaptive.set_draft_cost(0.2)  # 1 + 0.5 + 0.25 + ... against 1.2: still worth it
    assert adaptive.plan(["a"])[0] > 0
