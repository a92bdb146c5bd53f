"""A prefill/decode split with a real prefill worker process (spawn, gloo point-to-point, one
thread each): greedy outputs equal a co-located engine's over whole generations (plain, with
speculation trees, with a JSON grammar, with penalties and seeded sampling), the decode worker
computes no prompt token (its forwards see only decode rows), prompts partly in the decode
worker's prefix cache move only the rest, TTFT comes back split into parts that add up to it, an
aborted request's pages are dropped on arrival (no block leaks), and a prefill worker that hangs
or dies fails its waiting requests with an error naming it while later prompts run locally.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.disaggregated import launch_prefill_worker
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.kv_handoff import gather_pages, scatter_pages
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.runtime.tp_worker import GivenWeights
from tests.runtime.test_tensor_parallel import tiny

BLOCK = 16
CONFIG = EngineConfig(dtype="float32", cache=CacheConfig(block_size=BLOCK, num_blocks=96),
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
KWARGS = dict(dtype=torch.float32)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (length + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def weights():
    return tiny(4, 2)


@pytest.fixture(scope="module")
def split(weights):
    """The decode engine (this process) with its prefill worker; reused by the tests in order."""
    torch.set_num_threads(1)
    cfg, w = weights
    engine = Engine(LlamaModel(cfg, w, **KWARGS), None, CONFIG, eos_token_ids=(0,))
    engine.remote_prefill = launch_prefill_worker(engine, GivenWeights(cfg, w), KWARGS, threads=1,
                                                  startup_timeout_s=120)
    yield engine
    engine.remote_prefill.close()


def _colocated(weights, speculator=None) -> Engine:
    cfg, w = weights
    return Engine(LlamaModel(cfg, w, **KWARGS), None, CONFIG, eos_token_ids=(0,), speculator=speculator)


def _decode_rows_only(engine: Engine) -> list[int]:
    """Wrap the engine's model so every forward's token count is recorded."""
    seen: list[int] = []
    inner = engine.model.forward

    def forward(batch, kv):
        seen.append(batch.num_tokens - batch.num_seqs)  # rows past one per sequence
        return inner(batch, kv)

    engine.model.forward = forward
    return seen


def test_pages_round_trip_between_equal_caches(weights):
    """gather -> scatter moves exactly the chosen blocks and the logits row, into other block ids."""
    cfg, w = weights
    model = LlamaModel(cfg, w, **KWARGS)
    src, dst = model.allocate_kv_cache(8, BLOCK), model.allocate_kv_cache(8, BLOCK)
    for layer in src:
        for t in layer.tensors():
            t.copy_(torch.randn(t.shape))
    row = torch.randn(cfg.vocab_size)
    payload = gather_pages(src, [5, 2], row)
    assert payload.numel() == 2 * BLOCK * model.kv_bytes_per_token() + 4 * cfg.vocab_size
    got = scatter_pages(dst, [0, 7], payload, cfg.vocab_size)
    assert torch.equal(got[0], row)
    for a, b in zip(src, dst):
        for ta, tb in zip(a.tensors(), b.tensors()):
            assert torch.equal(tb[0], ta[5]) and torch.equal(tb[7], ta[2])
            assert not tb[1].any()
    with pytest.raises(ValueError, match="does not hold"):
        scatter_pages(dst, [0], payload, cfg.vocab_size)


def test_greedy_equals_colocated_and_decode_computes_no_prompt_token(split, weights):
    prompts = _prompts(4, 40, seed=1)  # 40..61 tokens: several chunks at 64 tokens a step
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = _colocated(weights).generate(prompts, params)
    sent = split.remote_prefill.num_prompt_tokens_moved
    extra = _decode_rows_only(split)
    try:
        got = split.generate(prompts, params)
    finally:
        del split.model.forward  # the class's method again
    assert got == want
    assert extra and max(extra) == 0  # one row per sequence (no drafts here): never a prompt chunk
    assert split.remote_prefill.num_prompt_tokens_moved - sent == sum(len(p) for p in prompts)


def test_sampling_penalties_and_speculation_continue_exactly(split, weights):
    from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
    from prescient.speculative.speculator import Speculator
    from tests.speculative.test_engine_speculation import OracleProposer

    prompts = [p * 3 for p in _prompts(2, 12, seed=2)]
    for params in (SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3,
                                  ignore_eos=True)):
        assert split.generate(prompts, params) == _colocated(weights).generate(prompts, params)
    # Speculation across the split: trees every step from an oracle that knows the plain greedy
    # continuation (a wrong branch, then the truth with a wrong last token), so accepted and
    # rejected drafts both reach the handed-off sequences whatever the timing of their arrival.
    # (An n-gram proposer on this random model drafted ~10 times in 240 tokens and its one
    # accepted token depended on when the prompts joined the batch.)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = _colocated(weights).generate(prompts, params)
    truth = {tuple(p): list(o) for p, o in zip(prompts, plain)}
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                  verify_cost={1: 1.0, 64: 1.0}))
    split.speculator = Speculator(OracleProposer(truth), BLOCK, adaptive)
    try:
        assert split.generate(prompts, params) == plain
        stats = split.speculator.stats
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    finally:
        split.speculator = None


def test_prefix_in_decode_cache_moves_only_the_rest(split):
    base = _prompts(1, 48, seed=3)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    split.generate([base], params)
    sent = split.remote_prefill.num_prompt_tokens_moved
    follow = base + [5, 6, 7, 8, 9]
    out = split.generate([follow], params)
    assert len(out[0]) == 4
    # the 3 full blocks of the first prompt were already here: only the last 5 tokens' block moved
    assert split.remote_prefill.num_prompt_tokens_moved - sent == len(follow) - 48
    assert split.block_manager.num_free_blocks == split.block_manager.num_blocks
    split.block_manager.check_invariants()


def test_ttft_split_adds_up_and_an_abort_drops_pages_in_flight(split):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    remote = split.remote_prefill
    a = split.add_request(_prompts(1, 30, seed=4)[0], params)
    b = split.add_request(_prompts(1, 33, seed=5)[0], params)
    num_b = remote.nums[b.request_id]
    deadline = time.monotonic() + 30
    while not any(int(h[1]) == num_b for h, *_ in list(remote._arrivals)):  # b's pages are here, unplaced
        assert time.monotonic() < deadline, "the prefill worker never answered"
        time.sleep(0.005)
    split.abort(b.request_id)
    firsts = {}
    while split.has_unfinished_requests():
        assert time.monotonic() < deadline, "split generation stalled"
        for out in split.step():
            firsts.setdefault(out.request_id, out)
    assert set(firsts) == {a.request_id}
    parts = firsts[a.request_id].ttft_split
    assert parts is not None and set(parts) == {"queue_s", "prefill_s", "transfer_s", "first_decode_s"}
    assert all(v >= 0 for v in parts.values()) and parts["prefill_s"] > 0
    ttft = firsts[a.request_id].token_times[0] - a.first_scheduled_time  # submit -> first token
    # the parts run from the same submit stamp to the first token's own stamp: equal up to
    # float rounding, however long the step's bookkeeping took
    assert abs(sum(parts.values()) - ttft) < 1e-6
    assert not remote._arrivals and not remote.pending
    blocks = split.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked: b's pages were never placed
    blocks.check_invariants()


@pytest.mark.slow
def test_real_model_split_equals_colocated(default_engine):
    """The default model (fp32), through build_engine's --pd-split path: greedy outputs with
    n-gram speculation, plain and under a JSON grammar, equal the co-located engine's."""
    import json

    from prescient.build import EngineSpec, build_engine
    from prescient.grammar import spec_from_response_format
    from tests.conftest import load_workloads, sibling_engine

    engine = build_engine(EngineSpec(dtype="float32", weights="float32", speculate="ngram", calibrate="off",
                                     kv_cache_gb=0.25, progress=False, pd_split=True))
    try:
        one = sibling_engine(default_engine, speculate="ngram", calibrate="off")
        tok = default_engine.tokenizer
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
        kinds: dict = {}
        for wl in load_workloads():
            kinds.setdefault(wl["workload"], wl["messages"])
        prompts = [kinds["chat"], next(m for k, m in kinds.items() if k != "chat")]
        params = SamplingParams(temperature=0.0, max_tokens=40)
        for grammar in (None, schema):
            for prompt in prompts:
                outs = []
                for e in (one, engine):
                    pending = None
                    if grammar is not None:
                        pending = e.grammar_compiler().submit(spec_from_response_format(
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": grammar}}))
                    req = e.add_request(tok.apply_chat_template(prompt), params, grammar=pending)
                    deadline = time.monotonic() + 120
                    while e.has_unfinished_requests():
                        assert time.monotonic() < deadline, "generation stalled"
                        e.step()
                    outs.append(req.output_token_ids)
                assert outs[0] == outs[1]
                if grammar is not None:
                    json.loads(tok.decode(outs[1]))
        assert engine.remote_prefill.num_handoffs == 4
    finally:
        engine.remote_prefill.close()


def test_a_hung_then_dead_prefill_worker_fails_its_requests_then_prompts_run_locally(weights):
    """A worker that stops answering fails its waiting request at the queue-wait bound; once it
    is dead, new prompts are prefilled by the decode worker itself. Its own engine and worker."""
    from dataclasses import replace

    cfg, w = weights
    config = replace(CONFIG, scheduler=replace(CONFIG.scheduler, max_queue_wait_s=1.0))
    engine = Engine(LlamaModel(cfg, w, **KWARGS), None, config, eos_token_ids=(0,))
    remote = engine.remote_prefill = launch_prefill_worker(engine, GivenWeights(cfg, w), KWARGS, threads=1,
                                                           startup_timeout_s=120)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    os.kill(remote.proc.pid, signal.SIGSTOP)  # the prompt is sent, and never answered
    r = engine.add_request(_prompts(1, 20, seed=6)[0], params)
    assert remote.has_pending()
    outs, t0 = [], time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - t0 < 10, "a hung prefill worker hung the engine"
        outs += engine.step()
        time.sleep(0.01)
    final = [o for o in outs if o.request_id == r.request_id and o.finished]
    assert final and final[0].finish_reason == "error" and "prefill worker did not hand over" in final[0].error
    os.kill(remote.proc.pid, signal.SIGKILL)
    remote.proc.join(10)
    while remote.accepts():
        assert time.monotonic() - t0 < 20, "the worker's death was not noticed"
        time.sleep(0.01)
    assert "prefill worker stopped" in remote.failure and "gloo" not in remote.failure
    later = engine.generate(_prompts(1, 20, seed=7), params)  # prefilled here now
    assert len(later[0]) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    remote.close()


def test_spec_refuses_what_the_split_cannot_serve():
    from prescient.build import EngineSpec

    with pytest.raises(ValueError, match="--tp"):
        EngineSpec(pd_split=True, tp=2)
    with pytest.raises(ValueError, match="draft model keeps its own KV"):
        EngineSpec(pd_split=True, speculate="draft")
