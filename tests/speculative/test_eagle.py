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

from prescient.kernels import cpu_linear
from prescient.runtime.loader import load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.eagle import EagleConfig, EagleProposer, _first_path, fingerprint, lm_head_rows
from prescient.speculative.eagle_head import EagleHead, HeadConfig, HeadRunner
from prescient.speculative.ngram import NgramProposer
from prescient.speculative.proposer import ProposalContext
from tests.conftest import make_tiny_checkpoint
from tests.kernels.kernel_oracles import run_at_tier
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


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_drafting_rows_equal_the_training_forward(target, native):
    """HeadRunner computing one row at a time over its own K/V (step_at: the native call, or
    step over copies of the rows) gives forward_train's rows."""
    head = random_head(target, seed=1)
    runner = HeadRunner(head, lm_head_rows(target, head.draft_ids), weights=torch.float32, native=native)
    assert (runner.native is not None) == native
    T, H = 9, target.config.hidden_size
    torch.manual_seed(2)
    embeds, feats = torch.randn(T, H), torch.randn(T, H)
    with torch.no_grad():
        ref = head.forward_train(embeds[None], feats[None], torch.arange(T))[0]
    kb, vb = torch.zeros(runner.kv_size, T), torch.zeros(T, runner.kv_size)
    for t in range(T):
        h, logits = runner.step_at(embeds[t:t + 1], feats[t:t + 1], torch.tensor([t]), kb, vb, t, t, None)
        torch.testing.assert_close(h[0], ref[t], atol=1e-4, rtol=1e-4)
    assert logits.shape == (1, head.cfg.draft_vocab)


# fp32 in another order (the native softmax's exp, SiLU's, the sums), through random linears that
# grow each layer's values ~2.4x: as test_drafting_rows_equal_the_training_forward allows
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_rows_kept_in_place_give_steps_rows(target, native):
    """step_at (K/V written into the caller's buffers, K transposed; the committed rows attended
    whole, the tree's rows by a mask) computes step's rows, in one native call and in torch ops:
    a 6-row catch-up over 5 committed rows, then a depth of 3 tree rows over 2 earlier tree rows,
    each attending to its own ancestors only."""
    head = random_head(target, seed=3)
    runner = HeadRunner(head, lm_head_rows(target, head.draft_ids), weights=torch.float32, native=native)
    assert (runner.native is not None) == native
    H, kv = target.config.hidden_size, runner.kv_size
    torch.manual_seed(4)
    kb, vb = torch.zeros(kv, 300), torch.zeros(300, kv)
    past = 5
    kb[:, :past], vb[:past] = torch.randn(kv, past), torch.randn(past, kv)
    e, f = torch.randn(6, H), torch.randn(6, H)
    pos = torch.arange(past, past + 6)
    causal = torch.ones(6, past + 6, dtype=torch.bool)
    causal[:, past:] = torch.ones(6, 6, dtype=torch.bool).tril()
    h_ref, k_ref, v_ref, l_ref = runner.step(e, f, pos, kb[:, :past].T.clone(), vb[:past].clone(), causal, [5])
    h, logits = runner.step_at(e, f, pos, kb, vb, past, past, None, logits_rows=[5])
    torch.testing.assert_close(h, h_ref, **TOL)
    torch.testing.assert_close(logits, l_ref, **TOL)
    torch.testing.assert_close(kb[:, past:past + 6].T, k_ref, **TOL)
    torch.testing.assert_close(vb[past:past + 6], v_ref, **TOL)
    committed = past + 6
    kb[:, committed:committed + 2], vb[committed:committed + 2] = torch.randn(kv, 2), torch.randn(2, kv)
    marks = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    e, f = torch.randn(3, H), torch.randn(3, H)
    pos = torch.tensor([12, 12, 12])
    attend = torch.cat([torch.ones(3, committed, dtype=torch.bool), marks], dim=1)
    h_ref, k_ref, v_ref, l_ref = runner.step(e, f, pos, kb[:, :committed + 2].T.clone(),
                                             vb[:committed + 2].clone(), attend)
    h, logits = runner.step_at(e, f, pos, kb, vb, committed + 2, committed, marks)
    torch.testing.assert_close(h, h_ref, **TOL)
    torch.testing.assert_close(logits, l_ref, **TOL)
    torch.testing.assert_close(kb[:, committed + 2:committed + 5].T, k_ref, **TOL)
    torch.testing.assert_close(vb[committed + 2:committed + 5], v_ref, **TOL)


@pytest.fixture
def isa_cap():
    yield run_at_tier
    cpu_linear._set_isa_cap(99)


@pytest.mark.parametrize("tier", cpu_linear.ISA_TIERS)
def test_the_native_step_over_a_long_context_equals_torchs(target, isa_cap, tier):
    """600 committed rows (past the 16- and 8-position vectors, with a tail), 5 tree rows held
    and 5 new ones (10 queries a kv head of the tiny model: a full block of 8 and a partial one),
    random masks, at every kernel tier this CPU runs (the attention has a loop per tier): the
    native call and the torch ops give the same rows, K/V and logits."""
    isa_cap(tier)
    head = random_head(target, seed=5)
    native = HeadRunner(head, lm_head_rows(target, head.draft_ids), weights=torch.float32)
    plain = HeadRunner(head, lm_head_rows(target, head.draft_ids), weights=torch.float32, native=False)
    assert native.native is not None
    H, kv = target.config.hidden_size, native.kv_size
    torch.manual_seed(6)
    cap, free, held, n = 700, 600, 5, 5
    kb, vb = torch.randn(kv, cap), torch.randn(cap, kv)
    e, f = torch.randn(n, H), torch.randn(n, H)
    pos = torch.tensor([101, 102, 102, 103, 103])  # RoPE positions: within the tiny model's table
    marks = torch.rand(n, held + n) < 0.5
    marks[:, held:] = torch.eye(n, dtype=torch.bool)
    bufs = [(kb.clone(), vb.clone()) for _ in range(2)]
    out = [r.step_at(e, f, pos, k, v, free + held, free, marks) for r, (k, v) in zip((native, plain), bufs)]
    torch.testing.assert_close(out[0][0], out[1][0], **TOL)
    torch.testing.assert_close(out[0][1], out[1][1], **TOL)
    for a, b in zip(*bufs):  # the new rows' K and V, written in place
        torch.testing.assert_close(a, b, **TOL)
    # no logits wanted: the rows and K/V still computed
    h, logits = native.step_at(e, f, pos, *bufs[0], free + held, free, marks, logits_rows=[])
    assert logits.shape == (0, head.cfg.draft_vocab)
    torch.testing.assert_close(h, out[1][0], **TOL)


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


def test_a_short_copy_shares_the_tree_with_the_heads_nodes(target, head_file):
    """The context ends with a 5-token repeat: an n-gram match shorter than ngram_min_match.
    Its continuation fills the first half of the budget as the tree's first path, the head's
    best nodes the rest; with ngram_share 0 the tree is the head's alone, as without n-gram."""
    text = random_tokens(24, 5)
    tokens = text + text[:5]
    hidden = torch.randn(len(tokens) - 1, target.config.hidden_size, dtype=target.dtype)
    def propose(**kw):
        p = EagleProposer(EagleConfig(target_model=target, head_path=head_file, ngram_min_match=6, **kw))
        p.on_features("r", 0, hidden)
        return p, p.propose([ProposalContext("r", None, tokens, 8)])[0]

    p, union = propose(ngram=NgramProposer())
    assert p.num_head_trees == 1 and p.num_ngram_trees == 0
    assert _first_path(union)[:4] == text[5:9]
    assert union.num_draft_tokens == 8
    _, head_only = propose(ngram=NgramProposer(), ngram_share=0.0)
    _, alone = propose()
    assert head_only == alone
    assert _first_path(alone)[:4] != text[5:9]  # the chain came from the copy, not the head


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
