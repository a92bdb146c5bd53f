"""The verify-cost table: measured one forward per `Calibration.step`, cached under its key and
reused by the next start, and measured in idle moments so that a request arriving meanwhile
waits for at most one calibration forward (tiny model, float64)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from prescient.runtime.async_engine import AsyncEngine
from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative import verify_cost
from prescient.speculative.speculator import make_speculator
from prescient.speculative.verify_cost import SIZES, Calibration


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    ckpt = load_checkpoint(str(tiny_llama_dir))
    return LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float64)


class CountingModel:
    """The model with its forwards counted (and stamped)."""

    def __init__(self, model):
        self.model, self.stamps = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, batch, kv):
        self.stamps.append(time.perf_counter())
        return self.model.forward(batch, kv)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_calibration_runs_one_forward_per_step(tiny):
    model = CountingModel(tiny)
    cal = Calibration(model, 8, repeats=2)
    steps = 0
    while not cal.step():
        steps += 1
        assert len(model.stamps) == steps  # each unfinished step ran exactly one forward
    contexts = 2 if cal.long_context else 1
    assert steps == contexts * len(SIZES) * (1 + 2)  # warm-up + repeats, every size, each context
    table = cal.tables.short
    assert sorted(table) == list(SIZES) and table[1] == 1.0
    assert all(table[a] <= table[b] for a, b in zip(SIZES, SIZES[1:]))  # never cheaper with more tokens
    assert cal.step() and len(model.stamps) == steps  # done: a further step does nothing


def test_a_measured_table_is_cached_and_reused(tiny, cache):
    first = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key="tiny|float64")
    assert first.calibration is not None  # nothing cached yet: measured when idle
    while first.idle_work():
        pass
    assert first.calibration is None and list(cache.glob("verify_cost/*.json"))
    again = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key="tiny|float64")
    assert again.calibration is None  # from the cache, nothing to measure
    sizes = torch.tensor(SIZES).numpy()
    assert (again.adaptive.cost_many(sizes, 256) == first.adaptive.cost_many(sizes, 256)).all()
    fresh = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key="tiny|float64", use_cache=False)
    assert fresh.calibration is not None  # `--calibrate fresh` measures whatever is cached
    other = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key="tiny|bfloat16")
    assert other.calibration is not None  # another key (dtype, CPU, kernel build) is another table


def test_until_measured_the_planner_uses_an_earlier_builds_table_or_a_cpus(tiny, cache):
    """A new kernel build (an upgrade) has no table yet: while it is measured the planner uses the
    newest table of a key that differs in the build alone; a key differing in anything else
    (another model) is not taken, and a CPU model then plans with CPU_VERIFY_COST."""
    from prescient.speculative.adaptive import CPU_VERIFY_COST
    from prescient.speculative.verify_cost import CostTables, save_cached

    key = "m|ngram|8|cpu-flags|/c/kernels/cpu_gemv-{}.so|avx2|2|copies cl default"
    older, newer = CostTables({1: 1.0, 8: 5.0}, 256), CostTables({1: 1.0, 8: 3.0}, 256)
    save_cached(key.format("aaaa"), older)
    save_cached(key.format("bbbb"), newer)
    save_cached(key.replace("m|", "other-model|").format("cccc"), CostTables({1: 1.0, 8: 9.0}, 256))
    sizes = torch.tensor([8]).numpy()
    upgraded = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key=key.format("dddd"))
    assert upgraded.calibration is not None  # its own build's table is still measured
    assert upgraded.adaptive.cost_many(sizes, 256)[0] == pytest.approx(3.0)  # the newest sibling
    fresh = make_speculator(tiny, 8, "ngram", calibrate="idle", cache_key="new-model|ngram|8|x|/c/cpu_gemv-ee.so|y")
    assert fresh.adaptive.cost_many(sizes, 256)[0] == pytest.approx(CPU_VERIFY_COST[8])
    while upgraded.idle_work():
        pass
    measured = verify_cost.load_cached(key.format("dddd"))
    assert measured is not None and measured.short[8] != 3.0  # then its own, measured


def test_the_cache_key_names_the_cpu_and_the_kernel_build(monkeypatch):
    key = verify_cost.cache_key("weights-hash|bfloat16|cpu", "ngram", 16)
    from prescient.kernels.cpu_linear import build_signature
    from prescient.kernels.quant_linear import default_layout

    assert key.startswith("weights-hash|bfloat16|cpu|ngram|16|" + build_signature())
    # and the weight copies the block kernels read: another budget is another table
    monkeypatch.setenv("PRESCIENT_REGROUP_MB", "0")
    assert verify_cost.cache_key("weights-hash|bfloat16|cpu", "ngram", 16) != key
    if default_layout() == "cl":
        monkeypatch.delenv("PRESCIENT_REGROUP_MB")
        monkeypatch.setenv("PRESCIENT_REGROUP_LAYOUT", "groups")
        assert verify_cost.cache_key("weights-hash|bfloat16|cpu", "ngram", 16) != key


def test_a_request_during_idle_calibration_waits_for_at_most_one_forward(tiny):
    model = CountingModel(tiny)
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    speculator = make_speculator(model, 8, "ngram", calibrate="idle")
    speculator.calibration = Calibration(model, 8, repeats=50)  # long enough to be mid-way
    engine = Engine(model, None, config, eos_token_ids=(2,), speculator=speculator)
    aengine = AsyncEngine(engine)
    # When the request reached the engine's inbox, stamped just after it did (a stamp taken on
    # this thread before `generate` would also count the forwards run while a loaded host kept
    # this thread from submitting; one taken after can only count fewer, never more)
    posted: list[float] = []
    post = aengine._post

    def stamped_post(fn):
        post(fn)
        posted.append(time.perf_counter())

    aengine._post = stamped_post

    async def one_request():
        while len(model.stamps) < 5:  # the idle loop has started calibrating
            await asyncio.sleep(0.001)
        outs = [o async for o in aengine.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0))]
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(one_request(), 60))
        assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == "length"
        submitted = posted[0]  # (the only post: the request, finished, is not aborted)
        scheduled = outs[0].token_times[0]  # the first token's commit time
        during = [t for t in model.stamps if submitted < t < scheduled]  # forwards started meanwhile
        # the request's own prefill forward, plus at most the one calibration forward in flight
        assert len(during) <= 2, len(during)
        deadline = time.perf_counter() + 60
        while speculator.calibration is not None and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert speculator.calibration is None  # finished later, in idle moments
    finally:
        aengine.shutdown()


def test_ratio_table_is_monotone_and_never_above_the_token_count():
    from prescient.speculative.verify_cost import ratio_table

    table = ratio_table({1: [1.0, 1.1], 2: [2.6, 2.35], 4: [1.9], 8: [3.0]})
    assert table == {1: 1.0, 2: 2.0, 4: 2.0, 8: 3.0}
