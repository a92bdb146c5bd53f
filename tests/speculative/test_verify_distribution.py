"""Speculation preserves the target distribution: the statistical test, on a toy model.

The toy "model" is a fixed random logits table indexed by the previous token (vocab 16), so the
target distribution of a 3-token continuation is exactly computable:
    P(a, b, c) = T[root, a] * T[a, b] * T[b, c],  T = target_probs_from_logits(table, params).
Many sequences are decoded in parallel: each step builds a draft tree per unfinished sequence
from a different toy draft distribution, verifies the whole batch in one call (verify_packed,
the tensor core of verify()) and appends the emitted tokens, until every sequence has 3.

The total variation distance between the empirical and exact distributions must stay within
0.02 for every kind of draft. Top-k/top-p keep the support small (at most 97 of the 4096
continuations), so exact sampling itself lands near 0.007-0.010 with 100k samples (the
root-only baseline below), while a deliberately wrong acceptance rule lands far above 0.1.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from prescient.kernels import ops, reference
from prescient.runtime.sampler import target_probs_from_logits
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.tree import DraftTree, pack_trees
from prescient.speculative.verify import verify_packed

VOCAB = 16
ROOT = 3
NUM_SEQS = 100_000
TVD_BOUND = 0.02

_tables = torch.Generator().manual_seed(1234)
TARGET_LOGITS = torch.randn(VOCAB, VOCAB, generator=_tables) * 1.5  # [prev token, next token]
# The draft: correlated with the target but clearly different (acceptance is far from 1).
DRAFT_LOGITS = 0.6 * TARGET_LOGITS + torch.randn(VOCAB, VOCAB, generator=_tables)

PARAMS = {
    "t0.8_k6_p0.9": SamplingParams(temperature=0.8, top_k=6, top_p=0.9),
    "t1.3_k5_p0.8_minp": SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
}


@pytest.fixture(autouse=True)
def _one_thread():
    # The tensors here are small (100k x 16): intra-op threads gain little and, on a busy 2-core
    # machine, spin against each other (measured 3-5x slower). Restored after each test.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A tree builder: last tokens [n] -> draft_tokens [n, max_nodes], parents [n, max_nodes],
# num_nodes [n] (the kernel layout of pack_trees) and flat draft_probs [sum(num_nodes), VOCAB]
# (None: deterministic drafts). Trees are built as tensors so 100k of them cost milliseconds.
PackedTrees = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
TreeBuilder = Callable[[torch.Tensor, SamplingParams], PackedTrees]


def sampled_chains(last: torch.Tensor, params: SamplingParams):
    """Chains of 1-3 tokens sampled from the draft distribution; draft_probs row c = the
    distribution node c's token was drawn from (its parent's draft distribution)."""
    draft_dist = target_probs_from_logits(DRAFT_LOGITS, params)  # [VOCAB, VOCAB]
    tokens = [last]
    for _ in range(3):
        tokens.append(torch.multinomial(draft_dist[tokens[-1]], 1)[:, 0])
    tokens = torch.stack(tokens, 1)  # [n, 4]
    rows = torch.cat([torch.zeros(len(last), 1, VOCAB), draft_dist[tokens[:, :3]]], 1)  # [n, 4, VOCAB]
    depth = torch.arange(len(last)) % 3 + 1  # mixed lengths exercise the padding
    keep = torch.arange(4) <= depth[:, None]  # [n, 4]
    parents = torch.where(keep, torch.arange(4) - 1, -1)
    return torch.where(keep, tokens, -1), parents, depth + 1, rows[keep]


def sampled_trees(last: torch.Tensor, params: SamplingParams):
    """SpecInfer-style i.i.d. siblings: 3 children of the root drawn independently from the
    draft (duplicates allowed), the first two with a sampled child each."""
    draft_dist = target_probs_from_logits(DRAFT_LOGITS, params)
    n = len(last)
    kids = torch.multinomial(draft_dist[last], 3, replacement=True)  # [n, 3]
    grandkids = torch.multinomial(draft_dist[kids[:, :2].flatten()], 1).view(n, 2)
    tokens = torch.cat([last[:, None], kids, grandkids], 1)  # [n, 6]: root, 3 kids, 2 grandkids
    parents = torch.tensor([-1, 0, 0, 0, 1, 2]).expand(n, 6)
    rows = draft_dist[tokens.gather(1, parents.clamp(min=0))]  # [n, 6, VOCAB]: the parent's draft; row 0 unused
    return tokens, parents, torch.full((n,), 6), rows.flatten(0, 1)


def _deterministic_tree(root: int) -> DraftTree:
    """A fixed multi-branch tree from the draft's ranking (like an n-gram or top-k tree): the
    top-3 first tokens, the top-2 under the best, 1 under the second, a third level under the
    best path."""
    draft_rank = DRAFT_LOGITS.argsort(-1, descending=True)  # [VOCAB, VOCAB]
    first = draft_rank[root, :3].tolist()
    second = draft_rank[first[0], :2].tolist()
    paths = [[first[0], second[0], int(draft_rank[second[0], 0])], [first[0], second[1]],
             [first[1], int(draft_rank[first[1], 0])], [first[2]]]
    return DraftTree.from_paths(root, paths)


DETERMINISTIC = pack_trees([_deterministic_tree(root) for root in range(VOCAB)])


def deterministic_trees(last: torch.Tensor, params: SamplingParams):
    """One-hot drafts: no draft_probs."""
    draft_tokens, parents, num_nodes = DETERMINISTIC
    return draft_tokens[last], parents[last], num_nodes[last], None


def root_only(last: torch.Tensor, params: SamplingParams):
    """No speculation: plain decoding through the same path."""
    return last[:, None], torch.full((len(last), 1), -1), torch.ones(len(last), dtype=torch.int64), None


def decode_three(params: SamplingParams, build: TreeBuilder, num_seqs: int = NUM_SEQS, seed: int = 0) -> torch.Tensor:
    """[num_seqs, 3] continuations of ROOT produced by speculation + verify_packed()."""
    torch.manual_seed(seed)  # unseeded requests and the toy drafts sample from the default generator
    max_emit = 8  # more than any builder's tree depth + 1
    out = torch.full((num_seqs, 3 + max_emit), -1, dtype=torch.int64)
    produced = torch.zeros(num_seqs, dtype=torch.int64)
    active = torch.arange(num_seqs)
    while len(active):
        done = produced[active]
        last = torch.where(done > 0, out[active, (done - 1).clamp(min=0)], ROOT)
        draft_tokens, parents, num_nodes, draft_probs = build(last, params)
        n = len(active)
        # the toy model at each node: [sum(num_nodes), VOCAB]
        target_logits = TARGET_LOGITS[draft_tokens[draft_tokens >= 0]]
        verdict = verify_packed(draft_tokens, parents, num_nodes, target_logits, [params] * n, [None] * n, draft_probs)
        # emitted: the accepted draft tokens, then the bonus/recovered token
        emitted = torch.full((n, max_emit), -1, dtype=torch.int64)
        width = draft_tokens.shape[1] - 1
        emitted[:, :width] = verdict.accepted_tokens[:, 1:]
        emitted[torch.arange(n), verdict.accept_len] = verdict.next_token
        count = verdict.accept_len + 1
        valid = torch.arange(max_emit) < count[:, None]  # [n, max_emit]
        slots = done[:, None] + torch.arange(max_emit)
        out[active[:, None].expand(n, max_emit)[valid], slots[valid]] = emitted[valid]
        produced[active] += count
        active = active[produced[active] < 3]
    return out[:, :3]


def exact_distribution(params: SamplingParams) -> torch.Tensor:  # [VOCAB ** 3]
    step = target_probs_from_logits(TARGET_LOGITS, params).double()  # [prev, next]
    joint = step[ROOT][:, None, None] * step[:, :, None] * step[None, :, :]  # [a, b, c]
    return joint.flatten()


def tvd(samples: torch.Tensor, params: SamplingParams) -> float:
    codes = samples[:, 0] * VOCAB**2 + samples[:, 1] * VOCAB + samples[:, 2]
    empirical = torch.bincount(codes, minlength=VOCAB**3).double() / len(samples)
    return 0.5 * float((empirical - exact_distribution(params)).abs().sum())


BUILDERS = {"sampled_chain": sampled_chains, "sampled_tree": sampled_trees, "deterministic_tree": deterministic_trees}


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("params_name", PARAMS)
def test_speculative_sampling_matches_target_distribution(builder, params_name):
    params = PARAMS[params_name]
    samples = decode_three(params, BUILDERS[builder])
    assert (samples >= 0).all()
    distance = tvd(samples, params)
    assert distance <= TVD_BOUND, f"{builder} / {params_name}: TVD {distance:.4f}"


def test_plain_sampling_baseline():
    """Reference point: root-only trees (plain decoding) through the same harness."""
    params = PARAMS["t0.8_k6_p0.9"]
    assert tvd(decode_three(params, root_only), params) <= TVD_BOUND


def _always_accept(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniform, recovery_noise):
    # Wrong on purpose: uniform draws of -1 pass every acceptance test (u * q < p).
    return reference.rejection_sample(draft_tokens, parents, num_nodes, target_probs,
                                      draft_probs, torch.zeros_like(uniform) - 1.0, recovery_noise)


def _recover_from_target(draft_tokens, parents, num_nodes, target_probs, draft_probs, uniform, recovery_noise):
    # Wrong on purpose, the classic slip: after a rejection, sample the next token from the
    # target itself instead of the residual norm(max(target - draft, 0)).
    accept_len, accepted_nodes, _ = reference.rejection_sample(
        draft_tokens, parents, num_nodes, target_probs, draft_probs, uniform, recovery_noise)
    rows = torch.arange(len(accept_len))
    last = accepted_nodes[rows, accept_len]
    return accept_len, accepted_nodes, (target_probs[rows, last] / recovery_noise).argmax(1)


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("wrong_rule", [_always_accept, _recover_from_target],
                         ids=["always_accept", "recover_from_target"])
def test_wrong_rules_fail_the_bound(monkeypatch, wrong_rule, builder):
    monkeypatch.setattr(ops, "rejection_sample", wrong_rule)
    params = PARAMS["t0.8_k6_p0.9"]
    distance = tvd(decode_three(params, BUILDERS[builder], num_seqs=NUM_SEQS // 4), params)
    assert distance > 5 * TVD_BOUND, f"{wrong_rule.__name__} / {builder}: TVD only {distance:.4f}"


@pytest.mark.parametrize("builder", BUILDERS)
def test_greedy_speculation_equals_greedy_decoding(builder):
    params = SamplingParams(temperature=0)
    samples = decode_three(params, BUILDERS[builder], num_seqs=2000)
    expected, token = [], ROOT
    for _ in range(3):
        token = int(TARGET_LOGITS[token].argmax())
        expected.append(token)
    assert (samples == torch.tensor(expected)).all()
