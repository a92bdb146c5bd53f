"""The EAGLE head proposer on a tiny random float64 target: the drafting arithmetic equals the
training forward row for row; the target's features reach the proposer for exactly the positions
it computed (chunks, accepted tree paths); greedy output with the head equals plain decoding; a
head trained for another target is refused; auto picks the head only where its verdict (measured
beside n-gram on this kernel tier, for this head file) says it pays."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.eagle import EagleConfig, EagleProposer, fingerprint, lm_head_rows
from prescient.speculative.eagle_head import EagleHead, HeadConfig, HeadRunner
from prescient.speculative.ngram import NgramProposer
from tests.conftest import make_tiny_checkpoint
from tests.runtime.test_model_reference import full_forward
# one torch thread, and the tiny float64 target of the draft-model tests
from tests.speculative.test_draft_model import engine_with, one_thread, target  # noqa: F401

VOCAB = 97


def random_head(model: LlamaModel, seed: int = 0, vocab: int = 60) -> EagleHead:
    torch.manual_seed(seed)
    ids = torch.randperm(VOCAB)[:vocab].sort().values
    head = EagleHead(HeadConfig.for_target(model.config, fingerprint(model), vocab), model.config, ids)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return head


@pytest.fixture(scope="module")
def head_file(target, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("heads") / "tiny.safetensors")
    random_head(target).save(path)
    return path


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def test_drafting_rows_equal_the_training_forward(target):
    """HeadRunner computing one row at a time over its own K/V gives forward_train's rows."""
    head = random_head(target, seed=1)
    runner = HeadRunner(head, lm_head_rows(target, head.draft_ids), weights=torch.float32)
    T, H = 9, target.config.hidden_size
    torch.manual_seed(2)
    embeds, feats = torch.randn(T, H), torch.randn(T, H)
    with torch.no_grad():
        ref = head.forward_train(embeds[None], feats[None], torch.arange(T))[0]
    ks = torch.zeros(0, runner.kv_size)
    vs = torch.zeros(0, runner.kv_size)
    for t in range(T):
        h, k, v, logits = runner.step(embeds[t:t + 1], feats[t:t + 1], torch.tensor([t]), ks, vs,
                                      torch.ones(1, t + 1, dtype=torch.bool))
        ks, vs = torch.cat([ks, k]), torch.cat([vs, v])
        torch.testing.assert_close(h[0], ref[t], atol=1e-4, rtol=1e-4)
    assert logits.shape == (1, head.cfg.draft_vocab)


class Recording(EagleProposer):
    """Keeps every feature hand-over, to check them against a reference forward."""

    def __init__(self, config):
        super().__init__(config)
        self.received: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def on_features(self, request_id, start, hidden):
        self.received.setdefault(request_id, []).append((start, self.model.features(hidden)))
        super().on_features(request_id, start, hidden)


def test_features_reach_the_proposer_for_the_positions_computed(target, head_file):
    """Prompts longer than a chunk of 32 (features in pieces), then verify steps (root + accepted
    nodes): every hand-over is the target's feature at those positions, and together they cover
    every position of the finished sequence but the last."""
    proposer = Recording(EagleConfig(target_model=target, head_path=head_file, top_k=2, max_depth=3))
    engine = engine_with(target, proposer)
    prompts = [random_tokens(n, 70 + n) for n in (5, 37)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for prompt in prompts:
        r = engine.add_request(prompt, params)
        outs[r.request_id] = r
    while engine.has_unfinished_requests():
        engine.step()
    assert proposer.num_head_trees > 0
    for rid, request in outs.items():
        seq = list(request.prompt_token_ids) + list(request.output_token_ids)
        target.keep_hidden = True
        try:
            full_forward(target, seq)
            ref = target.features(target.last_hidden)  # [len(seq), hidden]
        finally:
            target.keep_hidden = False
        covered = set()
        for start, f in proposer.received[rid]:
            torch.testing.assert_close(f, ref[start:start + f.shape[0]], atol=1e-5, rtol=1e-5)
            covered.update(range(start, start + f.shape[0]))
        assert covered == set(range(len(seq) - 1))


@pytest.mark.parametrize("top_k,with_ngram", [(1, False), (3, False), (3, True)])
def test_greedy_with_the_head_equals_plain(target, head_file, top_k, with_ngram):
    prompts = [random_tokens(n, 30 + n) for n in (4, 21, 45)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = engine_with(target, None).generate(prompts, params)
    proposer = EagleProposer(EagleConfig(target_model=target, head_path=head_file, top_k=top_k,
                                         ngram=NgramProposer() if with_ngram else None, ngram_min_match=2))
    engine = engine_with(target, proposer)
    assert engine.generate(prompts, params) == plain
    assert engine.speculator.stats.num_draft_tokens > 0
    assert proposer.num_head_trees > 0
    assert not proposer._states  # every request's state went with it
    # only the head engine's own forwards kept hidden states: an engine sharing the model does not
    assert target.keep_hidden is False and target.last_hidden is None


def test_a_head_for_another_target_is_refused(target, tmp_path):
    other = LlamaModel(*(lambda c: (c.config, c.weights))(load_checkpoint(str(
        make_tiny_checkpoint(tmp_path / "other", seed=5, num_hidden_layers=2)))), dtype=torch.float64)
    path = str(tmp_path / "other.safetensors")
    random_head(other).save(path)
    with pytest.raises(ValueError, match="trained for"):
        EagleProposer(EagleConfig(target_model=target, head_path=path))
    with pytest.raises(FileNotFoundError, match="train-head"):
        EagleProposer(EagleConfig(target_model=target, head_path=str(tmp_path / "absent.safetensors")))


def _verdict(head_file, **over):
    from prescient.speculative.head_verdict import file_sha256, kernel_tier

    return {"tier": kernel_tier(), "head_sha256": file_sha256(head_file), "pays": True, "eagle_over_ngram": 1.3,
            **over}


def test_auto_takes_the_head_only_where_it_was_measured_to_beat_ngram_here(target, monkeypatch, head_file):
    from prescient import build
    from prescient.speculative import eagle
    from prescient.speculative.head_verdict import verdict_path, write_verdict

    spec = build.EngineSpec(speculate="auto")
    monkeypatch.setattr(eagle, "head_path_for", lambda model: "/nonexistent/head.safetensors")
    assert build.speculate_choice(spec, target)[0] == "ngram"
    with pytest.raises(ValueError, match="train-head"):
        build.speculate_choice(build.EngineSpec(speculate="eagle"), target)[0]
    monkeypatch.setattr(eagle, "head_path_for", lambda model: head_file)
    verdict_path(head_file).unlink(missing_ok=True)
    assert build.speculate_choice(spec, target)[0] == "ngram"  # a head, never measured beside n-gram
    assert build.speculate_choice(build.EngineSpec(speculate="eagle"), target)[0] == "eagle"  # asked for by name
    try:
        write_verdict(head_file, _verdict(head_file))
        assert build.speculate_choice(spec, target) == ("eagle", None)
        assert build.speculate_choice(build.EngineSpec(speculate="auto", tp=2), target)[0] == "ngram"
        for stale in ({"pays": False, "eagle_over_ngram": 0.83}, {"tier": "some_other_tier"},
                      {"head_sha256": "0" * 64}):
            write_verdict(head_file, _verdict(head_file, **stale))
            method, why = build.speculate_choice(spec, target)
            assert method == "ngram" and head_file in why and "--speculate eagle" in why, stale
    finally:
        verdict_path(head_file).unlink(missing_ok=True)


def test_the_verdict_says_why_a_head_is_not_taken(head_file):
    from prescient.speculative.head_verdict import head_pays_here, verdict_path, write_verdict

    try:
        assert head_pays_here(head_file) == (False, "no measurement beside n-gram "
                                             "(run `prescient train-head --verdict-only`)")
        write_verdict(head_file, _verdict(head_file, pays=False, eagle_over_ngram=0.83))
        ok, why = head_pays_here(head_file)
        assert not ok and "0.83x" in why
        write_verdict(head_file, _verdict(head_file, tier="some_other_tier"))
        ok, why = head_pays_here(head_file)
        assert not ok and "kernel tier some_other_tier" in why
        verdict_path(head_file).write_text("{not json")
        assert head_pays_here(head_file)[0] is False
    finally:
        verdict_path(head_file).unlink(missing_ok=True)


def test_sampling_with_the_heads_trees_keeps_the_target_distribution(target, head_file):
    """Temperature sampling through the engine with the head's trees (one-hot drafts, the exact
    recursive rule): the first two tokens follow the target's own distribution, computed from
    its logits (2000 samples of a support of at most 9 pairs: TVD noise ~0.02, measured 0.011
    at 3000; the bound is 0.06)."""
    from prescient.runtime.sampler import target_probs_from_logits

    prompt = random_tokens(6, 4)
    base = SamplingParams(temperature=0.7, top_k=3, max_tokens=2, ignore_eos=True)
    logits = full_forward(target, prompt)[-1:]
    first = target_probs_from_logits(logits.float(), base)[0].double()  # [vocab]
    exact = {}
    for a in first.nonzero()[:, 0].tolist():
        second = target_probs_from_logits(full_forward(target, prompt + [a])[-1:].float(), base)[0].double()
        for b in second.nonzero()[:, 0].tolist():
            exact[(a, b)] = float(first[a] * second[b])
    from prescient.runtime.config import CacheConfig, SchedulerConfig
    from prescient.runtime.engine import Engine, EngineConfig
    from prescient.speculative.adaptive import AdaptiveConfig, AdaptiveSpeculation
    from prescient.speculative.speculator import Speculator

    proposer = EagleProposer(EagleConfig(target_model=target, head_path=head_file, top_k=3))
    adaptive = AdaptiveSpeculation(AdaptiveConfig(max_draft_tokens=6, prior_acceptance=1.0, verify_cost={1: 1.0, 64: 1.0}))
    # 32 requests a step: the draws are what is measured, not the batch
    engine = Engine(target, None, EngineConfig(cache=CacheConfig(block_size=8, num_blocks=256),
                                               scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256)),
                    eos_token_ids=(2,), speculator=Speculator(proposer, 8, adaptive))
    n, requests = 2000, []
    for wave in range(0, n, 200):  # within the waiting queue's bound
        requests += [engine.add_request(prompt, dataclasses.replace(base, seed=s)) for s in range(wave, wave + 200)]
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.speculator.stats.num_draft_tokens > 0
    counts: dict[tuple[int, int], int] = {}
    for r in requests:
        pair = tuple(r.output_token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    tvd = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    assert tvd <= 0.06, (tvd, counts, exact)
