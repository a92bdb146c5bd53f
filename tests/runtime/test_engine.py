"""Engine behaviour on a tiny random model in float64: continuous batching, chunked prefill,
preemption and prefix caching change nothing about greedy outputs; bad input is refused at
add_request and leaves the engine serving; seeds reproduce."""

from __future__ import annotations

import random

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


def make_engine(model, num_blocks=256, block_size=8, max_num_seqs=16, budget=64, prefix=True) -> Engine:
    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))
    return Engine(model, None, config, eos_token_ids=(2,))


def reference_greedy(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recomputation (no cache reuse), stopping at EOS like the engine."""
    from tests.runtime.test_model_reference import full_forward

    seq = list(prompt)
    out = []
    for _ in range(n):
        token = int(full_forward(model, seq)[-1].argmax())
        out.append(token)
        seq.append(token)
        if token == 2:
            break
    return out


def prompts(seed: int, count: int, lo=3, hi=60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_greedy_matches_full_recompute(tiny):
    engine = make_engine(tiny)
    ps = prompts(0, 3)
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=12))
    for p, o in zip(ps, outs):
        assert o == reference_greedy(tiny, p, 12)


def test_batching_chunking_preemption_do_not_change_outputs(tiny):
    ps = prompts(1, 10, hi=90)
    params = SamplingParams(temperature=0, max_tokens=20)
    solo = [make_engine(tiny).generate([p], params)[0] for p in ps]
    # tight memory (forces preemption) and a small token budget (forces chunked prefill)
    engine = make_engine(tiny, num_blocks=40, budget=32, max_num_seqs=8)
    batched = engine.generate(ps, params)
    assert batched == solo
    engine.block_manager.check_invariants()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_preemption_happens_and_recovers(tiny):
    engine = make_engine(tiny, num_blocks=24, budget=64, max_num_seqs=8)
    ps = prompts(2, 6, lo=30, hi=40)
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30)) for p in ps]
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    solo = [make_engine(tiny).generate([p], SamplingParams(temperature=0, max_tokens=30))[0] for p in ps]
    assert [r.output_token_ids for r in reqs] == solo


def test_prefix_cache_hits_shared_prompt(tiny):
    engine = make_engine(tiny)
    system = prompts(3, 1, lo=40, hi=40)[0]
    a = engine.add_request(system + [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    b = engine.add_request(system + [8, 9], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 40  # five full blocks of 8
    assert engine.block_manager.stats.hit_rate > 0
    # and the cached KV gives the same tokens as a cold engine
    assert b.output_token_ids == make_engine(tiny).generate([system + [8, 9]], SamplingParams(temperature=0, max_tokens=4))[0]


def test_kv_fuzz_random_arrivals_lengths_aborts(tiny):
    """After every request finishes or is aborted, every block is free (ref 0), possibly cached."""
    rng = random.Random(7)
    engine = make_engine(tiny, num_blocks=48, budget=48, max_num_seqs=6)
    live: list[str] = []
    for step in range(150):
        if rng.random() < 0.3:
            p = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 70))]
            r = engine.add_request(p, SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 25), seed=step))
            live.append(r.request_id)
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.block_manager.check_invariants()
    for rid in list(live):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_invariants()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("prompt,params,message", [
    ([], {}, "prompt is empty"),
    ([5] * 600, {}, "context"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ([5, 6], {"temperature": -1.0}, "temperature"),
    ([5, 6], {"stop": [3]}, "stop"),
    ([5, 6], {"top_p": 0.0}, "top_p"),
    ([5, 1000], {}, "token ids"),
])
def test_bad_input_is_refused_and_engine_survives(tiny, prompt, params, message):
    engine = make_engine(tiny)
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(**params))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(good.output_token_ids) == 5 or good.finish_reason == "stop"
    assert len(engine.requests) == 0


def test_seeded_sampling_reproducible(tiny):
    p = prompts(4, 1)[0]
    a = make_engine(tiny).generate([p], SamplingParams(temperature=3.0, top_k=50, seed=123, max_tokens=15))
    b = make_engine(tiny).generate([p], SamplingParams(temperature=3.0, top_k=50, seed=123, max_tokens=15))
    c = make_engine(tiny).generate([p], SamplingParams(temperature=3.0, top_k=50, seed=124, max_tokens=15))
    assert a == b
    assert a != c


def test_stop_token_ids_and_max_tokens(tiny):
    p = prompts(5, 1)[0]
    free = make_engine(tiny).generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = free[4]
    out = make_engine(tiny).generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                         stop_token_ids=(stop_at,)))[0]
    assert out == free[:free.index(stop_at) + 1]
    assert len(make_engine(tiny).generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]) == 3


def test_session_pins_keep_blocks_and_expire(tiny):
    engine = make_engine(tiny)
    p = prompts(6, 1, lo=50, hi=50)[0]
    r1 = engine.add_request(p, SamplingParams(temperature=0, max_tokens=6), session_id="s1")
    while engine.has_unfinished_requests():
        engine.step()
    pinned = engine.sessions.pinned_blocks("s1")
    assert len(pinned) == (50 + 6 - 1) // 8  # full blocks with valid KV
    assert all(engine.block_manager.blocks[b].ref_count == 1 for b in pinned)
    turn2 = p + r1.output_token_ids + [9, 10, 11]
    r2 = engine.add_request(turn2, SamplingParams(temperature=0, max_tokens=4), session_id="s1")
    while engine.has_unfinished_requests():
        engine.step()
    assert r2.num_cached_tokens == len(pinned) * 8
    engine.sessions.ttl_s = 0.0
    engine.sessions.pin("s1", engine.sessions.pinned_blocks("s1"))
    engine.sessions.expire()
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
