"""Acceptance rules: which draft tokens the target keeps, and the one token it adds.

Roles, defined once here and used everywhere else:
- draft tokens: a proposer's guesses, the tree's nodes below the root;
- bonus token: sampled from the target distribution at the last accepted node when that node
  has no children (nothing was rejected there): a token the step gets for free;
- recovered token: sampled from the residual distribution at the last accepted node after all
  its children were rejected; it replaces the rejected guesses.
Each step emits the accepted draft tokens plus exactly one bonus or recovered token, so a 1-node
tree (no proposal) is plain decoding: same distribution, and for a seeded request the same noise
draw (`exponential_noise((1, vocab))` first) as `Engine._sample`, so the same token.

Greedy requests keep the longest path whose tokens equal the target argmax, so speculation never
changes greedy output. Sampled requests use recursive rejection sampling, which is exact for any
draft: the emitted tokens follow the target distribution that `target_probs_from_logits` defines
(temperature, top-k, top-p, min-p), the same one plain decoding samples from. The walks
themselves are kernel ops (`prescient.kernels.ops.greedy_verify` / `rejection_sample`); this
module prepares their inputs (padding, per-request distributions and random draws) and turns
their outputs into per-request `VerifyOutcome`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prescient.kernels import ops
from prescient.runtime.sampler import exponential_noise, target_probs_from_logits
from prescient.runtime.sampling_params import SamplingParams
from prescient.speculative.tree import DraftTree, pack_trees

BONUS = "bonus"
RECOVERED = "recovered"


@dataclass(frozen=True)
class VerifyOutcome:
    """One request's verdict for one step."""

    accepted_nodes: tuple[int, ...]  # tree nodes on the accepted path, root (0) first
    accepted_tokens: tuple[int, ...]  # draft tokens kept: the tokens of accepted_nodes[1:]
    next_token: int  # the bonus or recovered token, emitted after the accepted drafts
    next_role: str  # BONUS or RECOVERED
    num_draft_tokens: int  # draft tokens the tree offered (its nodes below the root)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)

    @property
    def tokens(self) -> list[int]:
        """Everything this step emits, in order."""
        return [*self.accepted_tokens, self.next_token]

    def kv_moves(self, prefix_len: int) -> tuple[list[int], list[int]]:
        """(src, dst) sequence positions whose KV must be copied (`ops.kv_copy`, after mapping
        positions to slots): tree node i was written at prefix_len + i (docs/CONTRACTS.md), an
        accepted node belongs at prefix_len + its depth. Nodes already in place are skipped."""
        moves = [(prefix_len + node, prefix_len + depth)
                 for depth, node in enumerate(self.accepted_nodes) if node != depth]
        return [src for src, _ in moves], [dst for _, dst in moves]


def verify(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [sum(num_nodes), vocab]: each tree's nodes, trees in order
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    draft_probs: Sequence[torch.Tensor | None] | None = None,  # each [num_nodes, vocab] or None
) -> list[VerifyOutcome]:
    """Verify a batch of draft trees against the target's logits at their nodes.

    draft_probs[i] (sampled drafts only): row c is the distribution node c's token was sampled
    from, computed with `target_probs_from_logits(draft_logits, params[i])` so draft and target
    are shaped by the same temperature/top-k/top-p/min-p; row 0 is unused. None means the
    drafts were chosen deterministically (n-gram, top-k trees): one-hot drafts.
    A request with a generator draws its randomness from it alone (reproducible per seed,
    whatever else is in the batch); requests without one share torch's default generator."""
    num_nodes = [t.num_nodes for t in trees]
    if target_logits.shape[0] != sum(num_nodes):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {sum(num_nodes)} tree nodes")
    if not (len(params) == len(generators) == len(trees)):
        raise ValueError("trees, params and generators must have one entry per request")
    draft_probs = draft_probs if draft_probs is not None else [None] * len(trees)
    cu_nodes = [0]
    for n in num_nodes:
        cu_nodes.append(cu_nodes[-1] + n)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    one_hot = [i for i, p in enumerate(params) if not p.greedy and draft_probs[i] is None]
    sampled = [i for i, p in enumerate(params) if not p.greedy and draft_probs[i] is not None]
    outcomes: list[VerifyOutcome | None] = [None] * len(trees)
    if greedy:
        _verify_greedy(greedy, trees, target_logits, cu_nodes, outcomes)
    for group, with_draft_probs in ((one_hot, False), (sampled, True)):
        if group:
            _verify_sampled(group, trees, target_logits, cu_nodes, params, generators,
                            draft_probs if with_draft_probs else None, outcomes)
    return outcomes  # type: ignore[return-value]


def _verify_greedy(
    requests: list[int], trees: Sequence[DraftTree], target_logits: torch.Tensor,
    cu_nodes: list[int], outcomes: list[VerifyOutcome | None],
) -> None:
    sub_trees = [trees[i] for i in requests]
    draft_tokens, parents, num_nodes = pack_trees(sub_trees)
    rows, cols, flat = _node_index(requests, cu_nodes)
    # The same argmax plain greedy decoding takes (target_probs_from_logits is one-hot on it).
    target_argmax = torch.zeros_like(draft_tokens)  # [num_seqs, max_nodes]
    target_argmax[rows, cols] = target_logits[flat].argmax(-1)
    result = ops.greedy_verify(draft_tokens, parents, num_nodes, target_argmax)
    _collect(requests, sub_trees, draft_tokens, parents, *result, outcomes)


def _verify_sampled(
    requests: list[int], trees: Sequence[DraftTree], target_logits: torch.Tensor,
    cu_nodes: list[int], params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
    draft_probs: Sequence[torch.Tensor | None] | None, outcomes: list[VerifyOutcome | None],
) -> None:
    sub_trees = [trees[i] for i in requests]
    draft_tokens, parents, num_nodes = pack_trees(sub_trees)
    num_seqs, max_nodes = draft_tokens.shape
    vocab = target_logits.shape[1]
    rows, cols, flat = _node_index(requests, cu_nodes)
    target_probs = torch.zeros(num_seqs, max_nodes, vocab)  # [num_seqs, max_nodes, vocab]
    # One target_probs_from_logits call per distinct SamplingParams (agents mostly share them).
    by_params: dict[SamplingParams, list[int]] = {}
    for seq, i in enumerate(requests):
        by_params.setdefault(params[i], []).append(seq)
    for request_params, seqs in by_params.items():
        pick = torch.isin(rows, torch.tensor(seqs)) if len(seqs) < num_seqs else slice(None)
        target_probs[rows[pick], cols[pick]] = target_probs_from_logits(target_logits[flat[pick]], request_params)
    packed_draft_probs = None
    if draft_probs is not None:
        packed_draft_probs = torch.zeros(num_seqs, max_nodes, vocab)  # [num_seqs, max_nodes, vocab]
        packed_draft_probs[rows, cols] = torch.cat([draft_probs[i].float() for i in requests])
    uniform, recovery_noise = _random_draws(requests, [t.num_nodes for t in sub_trees], generators, max_nodes, vocab)
    result = ops.rejection_sample(draft_tokens, parents, num_nodes, target_probs, packed_draft_probs,
                                  uniform, recovery_noise)
    _collect(requests, sub_trees, draft_tokens, parents, *result, outcomes)


def _random_draws(
    requests: list[int], num_nodes: list[int], generators: Sequence[torch.Generator | None],
    max_nodes: int, vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """uniform [num_seqs, max_nodes] (column c judges node c; column 0 unused) and
    recovery_noise [num_seqs, vocab], Exp(1). A request with a generator draws the noise first,
    then one uniform per draft node, so a 1-node tree consumes exactly what plain sampling
    does; requests without one draw together from the default generator."""
    uniform = torch.zeros(len(requests), max_nodes)
    recovery_noise = torch.empty(len(requests), vocab)
    shared = [seq for seq, i in enumerate(requests) if generators[i] is None]
    if shared:
        recovery_noise[shared] = exponential_noise((len(shared), vocab), None)
        uniform[shared, 1:] = torch.rand(len(shared), max_nodes - 1)
    for seq, i in enumerate(requests):
        generator = generators[i]
        if generator is not None:
            recovery_noise[seq] = exponential_noise((1, vocab), generator)[0]
            uniform[seq, 1 : num_nodes[seq]] = torch.rand(num_nodes[seq] - 1, generator=generator)
    return uniform, recovery_noise


def _node_index(requests: list[int], cu_nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every node of the selected requests: (seq row in the packed batch, node column,
    row in the flat target_logits), each [num_selected_nodes] int64."""
    starts = torch.tensor([cu_nodes[i] for i in requests], dtype=torch.int64)
    counts = torch.tensor([cu_nodes[i + 1] - cu_nodes[i] for i in requests], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(requests)), counts)
    cols = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return rows, cols, starts[rows] + cols


def _collect(
    requests: list[int], sub_trees: list[DraftTree],
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes]
    parents: torch.Tensor,  # [num_seqs, max_nodes]
    accept_len: torch.Tensor,  # [num_seqs]
    accepted_nodes: torch.Tensor,  # [num_seqs, max_nodes], padded -1
    next_token: torch.Tensor,  # [num_seqs]
    outcomes: list[VerifyOutcome | None],
) -> None:
    rows = torch.arange(len(requests))
    last = accepted_nodes[rows, accept_len]
    # A rejection happened iff the last accepted node has children: then the next token is the
    # residual's sample (recovered); at a leaf it is the target's own sample (bonus).
    rejected = (parents == last[:, None]).any(1).tolist()
    path_tokens = draft_tokens.gather(1, accepted_nodes.clamp(min=0)).tolist()
    for seq, (i, n, nodes, toks, token, rej) in enumerate(zip(
            requests, accept_len.tolist(), accepted_nodes.tolist(), path_tokens, next_token.tolist(), rejected)):
        outcomes[i] = VerifyOutcome(tuple(nodes[: n + 1]), tuple(toks[1 : n + 1]), token,
                                    RECOVERED if rej else BONUS, sub_trees[seq].num_draft_tokens)
