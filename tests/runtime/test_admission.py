"""Admission against the KV cache's real capacity (issue 13): a request that can never fit is
refused at once, one that outgrows the cache ends with "length", one that fits only later waits
without holding up those that fit now (a bounded number of times), and the waiting queue is
bounded in length and in time. Tiny float64 model, 8-token blocks."""

from __future__ import annotations

import time

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.request import OverloadedError
from prescient.runtime.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def make_engine(model, num_blocks=16, budget=256, **scheduler) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, **scheduler))
    return Engine(model, None, config, eos_token_ids=(2,))


def run(engine, max_steps=1000) -> int:
    """Step until idle; fails (instead of hanging) if the engine stops making progress."""
    for n in range(max_steps):
        if not engine.has_unfinished_requests():
            return n
        engine.step()
    raise AssertionError(f"still busy after {max_steps} steps: running {len(engine.scheduler.running)}, "
                         f"waiting {len(engine.scheduler.waiting)}")


def step_until(engine, pred, max_steps=500) -> None:
    for _ in range(max_steps):
        if pred():
            return
        engine.step()
    raise AssertionError("condition not reached")


def test_prompt_larger_than_the_kv_cache_is_refused_naming_both_numbers(tiny):
    engine = make_engine(tiny, num_blocks=8)  # 64 tokens, far under the 512-token context
    assert engine.kv_capacity == 64 and engine.max_seq_len == 64
    with pytest.raises(ValueError, match=r"prompt has 64 tokens; the KV cache holds 64 tokens"):
        engine.add_request([5] * 64)
    assert not engine.requests and not engine.has_unfinished_requests()
    good = engine.add_request([5] * 63, SamplingParams(max_tokens=5, **GREEDY))  # 63 + 1 fits
    run(engine)
    assert good.finish_reason == "length" and len(good.output_token_ids) == 1


def test_output_outgrowing_the_whole_cache_ends_with_length(tiny):
    """Used to preempt itself at the cache's end and then never be scheduled again (a spin)."""
    engine = make_engine(tiny, num_blocks=8)
    r = engine.add_request([5, 6, 7], SamplingParams(max_tokens=500, **GREEDY))
    run(engine, max_steps=200)
    assert r.finish_reason == "length" and r.num_tokens == engine.kv_capacity
    assert r.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_that_fits_only_later_does_not_block_those_that_fit_now(tiny):
    engine = make_engine(tiny)  # 16 blocks = 128 tokens
    a = engine.add_request([5] * 8, SamplingParams(max_tokens=100, **GREEDY))
    step_until(engine, lambda: len(a.block_ids) == 8)  # a holds half the cache and keeps growing
    big = engine.add_request([6] * 65, SamplingParams(max_tokens=4, **GREEDY))  # 9 blocks: only after a
    small = engine.add_request([7] * 3, SamplingParams(max_tokens=2, **GREEDY))
    step_until(engine, lambda: small.finish_reason is not None, max_steps=10)
    assert a.finish_reason is None and big.first_scheduled_time is None  # small went past big
    assert big.num_overtaken == 1
    run(engine)
    assert a.finish_reason == big.finish_reason == "length" and len(big.output_token_ids) == 4
    engine.block_manager.check_invariants()


def test_overtaking_is_bounded_so_the_big_one_gets_its_turn(tiny):
    engine = make_engine(tiny, max_overtakes=1)
    a = engine.add_request([5] * 8, SamplingParams(max_tokens=60, **GREEDY))
    step_until(engine, lambda: len(a.block_ids) == 8)
    big = engine.add_request([6] * 65, SamplingParams(max_tokens=4, **GREEDY))
    first = engine.add_request([7] * 3, SamplingParams(max_tokens=2, **GREEDY))
    second = engine.add_request([8] * 3, SamplingParams(max_tokens=2, **GREEDY))
    run(engine)
    assert first.first_scheduled_time < big.first_scheduled_time  # one overtake allowed
    assert big.first_scheduled_time <= second.first_scheduled_time  # then big's turn
    assert all(r.finish_reason == "length" for r in (a, big, first, second))


def test_session_pins_give_way_to_a_request_that_needs_the_whole_cache(tiny):
    engine = make_engine(tiny, num_blocks=8)
    engine.add_request([5] * 40, SamplingParams(max_tokens=8, **GREEDY), session_id="s")
    run(engine)
    assert engine.sessions.pinned_blocks("s")
    r = engine.add_request([6] * 60, SamplingParams(max_tokens=4, **GREEDY))
    run(engine)
    assert r.finish_reason == "length" and len(r.output_token_ids) == 4 and len(engine.sessions) == 0


def test_queue_full_is_overloaded_and_changes_nothing(tiny):
    engine = make_engine(tiny, max_num_seqs=1, max_waiting=2, retry_after_s=3.0)
    reqs = [engine.add_request([5, 6], SamplingParams(max_tokens=3, **GREEDY)) for _ in range(2)]
    with pytest.raises(OverloadedError, match="2 requests are already waiting") as err:
        engine.add_request([5, 6], SamplingParams(max_tokens=3, **GREEDY), request_id="third")
    assert err.value.retry_after_s == 3.0 and "third" not in engine.requests
    run(engine)
    assert all(r.finish_reason == "length" for r in reqs)


def test_a_request_not_started_in_time_ends_overloaded_but_a_preempted_one_waits(tiny):
    engine = make_engine(tiny, max_num_seqs=1, max_queue_wait_s=5.0, retry_after_s=2.5)
    a = engine.add_request([5, 6], SamplingParams(max_tokens=20, **GREEDY))
    engine.step()
    late = engine.add_request([7, 8], SamplingParams(max_tokens=3, **GREEDY), arrival_time=time.perf_counter() - 6)
    outs = engine.step()
    refused = [o for o in outs if o.request_id == late.request_id]
    assert len(refused) == 1 and refused[0].finished and refused[0].finish_reason == "error"
    assert refused[0].error_type == "overloaded" and refused[0].retry_after_s == 2.5
    assert "waited" in refused[0].error and late.request_id not in engine.requests
    # A request that already started is never expired, even when preempted back to the queue.
    a.arrival_time -= 60
    engine.scheduler._preempt(a)
    run(engine)
    assert a.finish_reason == "length" and len(a.output_token_ids) == 20 and a.num_preemptions == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
