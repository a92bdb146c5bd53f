"""The draft gate and the self-quantized draft, on tiny random models: the rule is E(k) / T(k + 1)
maximised over chain lengths; a draft whose measured acceptance and cost table give no speedup
is refused (with its figures named) unless forced, one that pays starts; the measured
acceptance is cached; the target's quantized copy drafts losslessly and is refused when the
target's own blocks are as small."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prescient.runtime.config import CacheConfig, SchedulerConfig
from prescient.runtime.engine import Engine, EngineConfig
from prescient.runtime.loader import ModelLoadError, load_checkpoint, quantize_linears
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative import draft_gate
from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
from prescient.speculative.draft_gate import DraftCannotPay, check_draft_pays, expected_tokens, judge
from prescient.speculative.draft_model import DraftModelConfig, DraftModelProposer, self_quantized_draft
from prescient.speculative.speculator import Speculator
from prescient.speculative.verify_cost import CostTables
from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from a second thread on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return load_checkpoint(str(make_tiny_checkpoint(tmp_path_factory.mktemp("gate_target"), num_hidden_layers=3)))


@pytest.fixture(scope="module")
def target(checkpoint) -> LlamaModel:
    return LlamaModel(checkpoint.config, checkpoint.weights, dtype=torch.float64)


def speculator_for(target: LlamaModel, **draft) -> Speculator:
    config = DraftModelConfig(target_model=target, max_depth=4, block_size=8, num_blocks=64, **draft)
    return Speculator(DraftModelProposer(config), 8, AdaptiveSpeculation())


def per_token_table(draft_cost: float) -> CostTables:
    """A target whose verify is nearly flat, plus draft_cost plain steps per drafted token."""
    return CostTables({t: 1.0 + 0.02 * (t - 1) + draft_cost * (t - 1) for t in (1, 2, 4, 8)})


def test_rule_is_expected_tokens_over_step_cost():
    table = {1: 1.0, 2: 1.5, 4: 2.2, 8: 4.0}
    verdict = judge(0.8, 100, table, max_draft_tokens=4)
    by_hand = {1: 1.8 / 1.5, 2: (1.8 + 0.64) / 1.85, 3: (1.8 + 0.64 + 0.512) / 2.2,
               4: (1.8 + 0.64 + 0.512 + 0.4096) / (2.2 + 1.8 / 4)}
    best_k = max(by_hand, key=by_hand.get)
    assert verdict.best_k == best_k
    assert verdict.best_speedup == pytest.approx(by_hand[best_k])
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    # a draft that is never right cannot pay, however cheap its forwards
    assert not judge(0.0, 10, {1: 1.0, 2: 1.0, 8: 1.0}).pays
    with pytest.raises(ValueError, match="acceptance"):
        judge(1.5, 10, table)


def test_refuses_a_draft_whose_table_cannot_pay(target, monkeypatch, tmp_path):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    spec = speculator_for(target, early_exit_layers=1)
    tables = per_token_table(0.9)  # a draft forward nearly as costly as a target step
    with pytest.raises(DraftCannotPay) as refused:
        check_draft_pays(spec, target, "early exit (1 of 3 layers)", tables=tables)
    message = str(refused.value)
    assert "early exit (1 of 3 layers)" in message and "draft acceptance" in message
    assert "best expected speedup" in message and "--force-draft" in message
    verdict = check_draft_pays(spec, target, "early exit", tables=tables, force=True)
    assert not verdict.pays and 0 <= verdict.acceptance <= 1 and verdict.num_scored > 0
    assert f"{verdict.best_speedup:.2f}x" in message


def test_starts_a_draft_that_pays(target, monkeypatch, tmp_path):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    spec = speculator_for(target, early_exit_layers=3)  # the full target: always right
    verdict = check_draft_pays(spec, target, "self", tables=per_token_table(0.1))
    assert verdict.acceptance == 1.0
    assert verdict.pays and verdict.best_k == 4  # the proposer's max_depth bounds the chain
    # the same draft at a cost it cannot recover is refused: acceptance alone is not enough
    with pytest.raises(DraftCannotPay):
        check_draft_pays(spec, target, "self", tables=per_token_table(1.0))


def test_acceptance_is_cached_under_the_key(target, monkeypatch, tmp_path):
    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    spec = speculator_for(target, early_exit_layers=3)
    first = check_draft_pays(spec, target, "self", cache_key="k1", tables=per_token_table(0.1))

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(draft_gate, "measure_acceptance", no_measuring)
    again = check_draft_pays(spec, target, "self", cache_key="k1", tables=per_token_table(0.1))
    assert (again.acceptance, again.num_scored) == (first.acceptance, first.num_scored)
    with pytest.raises(AssertionError, match="measured again"):
        check_draft_pays(spec, target, "self", cache_key="k1", tables=per_token_table(0.1), use_cache=False)


def test_self_quantized_draft_is_lossless_in_the_engine(target, checkpoint):
    draft = self_quantized_draft(target, checkpoint.weights, "self-int8")
    assert draft.num_layers == target.num_layers
    assert set(draft.weight_formats()) == {"q8_0"}
    assert draft.weight_bytes() < target.weight_bytes() / 2
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    prompts = [[5 + (7 * i + n) % 90 for i in range(n)] for n in (4, 21, 45)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = Engine(target, None, config, eos_token_ids=(2,)).generate(prompts, params)
    proposer = DraftModelProposer(DraftModelConfig(draft_model=draft, target_model=target, block_size=8,
                                                   num_blocks=64))
    # always speculate (prior 1.0, flat verify cost) so that every step carries a draft
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=8, prior_acceptance=1.0,
                                                  verify_cost={1: 1.0, 64: 1.0}))
    engine = Engine(target, None, config, eos_token_ids=(2,), speculator=Speculator(proposer, 8, adaptive))
    assert engine.generate(prompts, params) == plain
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.5  # an int8 copy agrees with its target far more than chance


def test_self_quantized_draft_refused_for_a_target_in_blocks(checkpoint):
    blocks = quantize_linears(checkpoint.weights, "int4")
    target = LlamaModel(checkpoint.config, blocks, dtype=torch.float32)
    for name in ("self-int4", "self-int8"):
        with pytest.raises(ModelLoadError, match="cannot pay"):
            self_quantized_draft(target, blocks, name)
    with pytest.raises(ValueError, match="self-int4"):
        self_quantized_draft(target, checkpoint.weights, "self-int2")


def test_build_engine_runs_the_gate(tiny_llama_dir, monkeypatch, tmp_path):
    """`build_engine(speculate="draft")`: a draft judged unable to pay refuses to start, naming
    its figures; force_draft starts it; calibrate="off" (no measured table) skips the gate; a
    self-int8 draft is the target's quantized copy and decodes as plain greedy does."""
    from prescient import build
    from prescient.build import EngineSpec, LoadedModel, build_engine

    monkeypatch.setenv("PRESCIENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(draft_gate, "measure_acceptance", lambda *args, **kwargs: (0.0, 40))
    ckpt = load_checkpoint(str(tiny_llama_dir))
    loaded = LoadedModel(LlamaModel(ckpt.config, ckpt.weights, dtype=torch.float32), None, (2,), None)
    # the self-quantized draft reads the target's weights again (no tokenizer in this folder)
    monkeypatch.setattr(build, "load_model_files", lambda *args, **kwargs: ckpt)
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", speculate="draft", calibrate="now",
                      kv_cache_gb=0.01, progress=False)
    with pytest.raises(DraftCannotPay, match=r"early exit \(1 of 2 layers\): draft acceptance 0.00"):
        build_engine(spec, loaded)
    assert build_engine(dataclasses.replace(spec, force_draft=True), loaded).speculator is not None
    assert build_engine(dataclasses.replace(spec, calibrate="off"), loaded).speculator is not None
    quantized = build_engine(dataclasses.replace(spec, draft_model="self-int8", force_draft=True), loaded)
    assert quantized.speculator.proposer.model.weight_formats() == ("q8_0",)
    plain = build_engine(dataclasses.replace(spec, speculate="off"), loaded)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 22], [7] * 11]
    assert quantized.generate(prompts, params) == plain.generate(prompts, params)
