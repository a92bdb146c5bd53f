"""Acceptance rules: which draft tokens the target keeps, and the one token it adds.

Roles, defined once here and used everywhere else:
- draft tokens: a proposer's guesses, the tree's nodes below the root;
- bonus token: sampled from the target distribution at the last accepted node when that node
  has no children (nothing was rejected there): a token the step gets for free;
- recovered token: sampled from the residual distribution at the last accepted node after all
  its children were rejected; it replaces the rejected guesses.
Each step emits the accepted draft tokens plus exactly one bonus or recovered token, so a 1-node
tree (no proposal) is plain decoding: same distribution, and for a seeded request the same
draw (`runtime.sampler.sample_row`, which plain decoding calls too), so the same token.

Greedy requests keep the longest path whose tokens equal the target argmax, so speculation never
changes greedy output. Sampled requests use recursive rejection sampling, which is exact for any
draft: the emitted tokens follow the target distribution that `target_probs_from_logits` defines
(temperature, top-k, top-p, min-p), the same one plain decoding samples from. The walks
themselves are kernel ops (`prescient.kernels.ops.greedy_verify` / `rejection_sample`); this
module prepares their inputs (padding, per-request distributions and random draws) and turns
their outputs into per-request `VerifyOutcome`s (`verify`) or batch tensors (`verify_packed`).
On the CPU drafted trees of one-hot drafts are walked here instead: a greedy request's after one
argmax per row (`_walk_greedy`), a sampled request's with the reference walk's rule at one
sequence, a node's distribution computed when reached and the last token drawn by inverting the
residual's CDF (`_walk_one_hot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prescient.kernels import ops
from prescient.kernels.cpu_argmax import argmax_rows
from prescient.runtime.sampler import exponential_noise, inverse_cdf, sample_row, target_probs_from_logits
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
    if not (len(params) == len(generators) == len(trees)):
        raise ValueError("trees, params and generators must have one entry per request")
    # A tree without drafts is plain decoding (the module's first paragraph): its token is
    # plain decoding's own draw (sampler.sample_row: the same draw, the same token), without the tree
    # machinery, which cost a sampled request 1.5 ms a step on a 2-core Zen 3 (~15% of a step,
    # on every step the planner gives no drafts).
    single = [i for i, t in enumerate(trees)
              if t.num_nodes == 1 and (draft_probs is None or draft_probs[i] is None)]
    # A sampled request's deterministic (one-hot) drafts on the CPU: the walk one node at a time
    # (_walk_one_hot), the batch walk's rule at one sequence, on the rows it visits.
    walk = [i for i, t in enumerate(trees)
            if t.num_nodes > 1 and not params[i].greedy and target_logits.device.type == "cpu"
            and (draft_probs is None or draft_probs[i] is None)]
    # A greedy request's drafts on the CPU: one argmax per row (the one plain greedy decoding
    # takes), then the walk in plain Python over the tree's few nodes -- the batch path's ~30
    # small tensor ops cost ~0.6 ms a verify step on a 2-core Xeon (avx512_bf16), a tenth of a
    # 4-node step.
    greedy_walk = [i for i, t in enumerate(trees)
                   if t.num_nodes > 1 and params[i].greedy and target_logits.device.type == "cpu"
                   and (draft_probs is None or draft_probs[i] is None)]
    if single or walk or greedy_walk:
        starts = [0]
        for tree in trees:
            starts.append(starts[-1] + tree.num_nodes)
        if target_logits.shape[0] != starts[-1]:
            raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {starts[-1]} tree nodes")
        outcomes: list[VerifyOutcome | None] = [None] * len(trees)
        for i in single:
            token = sample_row(target_logits[starts[i]:starts[i] + 1], params[i], generators[i])
            outcomes[i] = VerifyOutcome((0,), (), token, BONUS, 0)
        for i in walk:
            outcomes[i] = _walk_one_hot(trees[i], target_logits[starts[i]:starts[i + 1]], params[i], generators[i])
        for i in greedy_walk:  # a view of the tree's rows (a gather would copy vocab-wide rows)
            outcomes[i] = _walk_greedy(trees[i], argmax_rows(target_logits[starts[i]:starts[i + 1]]).tolist())
        rest = [i for i in range(len(trees)) if outcomes[i] is None]
        if rest:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest]).to(target_logits.device)
            got = verify([trees[i] for i in rest], target_logits[rows], [params[i] for i in rest],
                         [generators[i] for i in rest],
                         None if draft_probs is None else [draft_probs[i] for i in rest])
            for i, outcome in zip(rest, got):
                outcomes[i] = outcome
        return outcomes
    draft_tokens, parents, num_nodes = pack_trees(trees)
    flat_draft_probs = None
    if draft_probs is not None and any(d is not None for d in draft_probs):
        # One-hot rows for the deterministic drafts of the batch: the same rule (see below).
        device = target_logits.device
        flat_draft_probs = torch.zeros(target_logits.shape, dtype=torch.float32, device=device)
        flat_tokens = torch.tensor([t for tree in trees for t in tree.tokens], device=device)
        flat_draft_probs[torch.arange(len(flat_tokens), device=device), flat_tokens] = 1.0
        start = 0
        for tree, probs in zip(trees, draft_probs):
            if probs is not None:
                flat_draft_probs[start : start + tree.num_nodes] = probs
            start += tree.num_nodes
    verdict = verify_packed(draft_tokens, parents, num_nodes, target_logits, params, generators, flat_draft_probs)
    return verdict.outcomes()


@dataclass(frozen=True)
class BatchVerdict:
    """verify_packed's result, one row per request."""

    accept_len: torch.Tensor  # [num_seqs] int64: draft tokens accepted
    accepted_nodes: torch.Tensor  # [num_seqs, max_nodes] int64: path from the root, padded -1
    accepted_tokens: torch.Tensor  # [num_seqs, max_nodes] int64: their tokens (root's first), padded -1
    next_token: torch.Tensor  # [num_seqs] int64: the bonus or recovered token
    recovered: torch.Tensor  # [num_seqs] bool: next_token is recovered (else bonus)
    num_nodes: torch.Tensor  # [num_seqs] int64: tree sizes, root included

    def outcomes(self) -> list[VerifyOutcome]:
        rows = zip(self.accept_len.tolist(), self.accepted_nodes.tolist(), self.accepted_tokens.tolist(),
                   self.next_token.tolist(), self.recovered.tolist(), self.num_nodes.tolist())
        return [VerifyOutcome(tuple(nodes[: n + 1]), tuple(toks[1 : n + 1]), token,
                              RECOVERED if rec else BONUS, size - 1)
                for n, nodes, toks, token, rec, size in rows]


def verify_packed(
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes] int64, node 0 = root, padding -1
    parents: torch.Tensor,  # [num_seqs, max_nodes] int64, padding -1
    num_nodes: torch.Tensor,  # [num_seqs] int64
    target_logits: torch.Tensor,  # [sum(num_nodes), vocab]: each tree's nodes, trees in order
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,  # [sum(num_nodes), vocab] or None = one-hot drafts
) -> BatchVerdict:
    """`verify` on trees already in the kernel layout (`pack_trees`), results as tensors (on
    target_logits' device): for callers that keep a whole batch in tensors. Rows of draft_probs
    for deterministic drafts must be one-hot on the node's token (which judges them exactly as
    a None would)."""
    device = target_logits.device
    draft_tokens, parents, num_nodes = draft_tokens.to(device), parents.to(device), num_nodes.to(device)
    num_seqs, max_nodes = draft_tokens.shape
    if target_logits.shape[0] != int(num_nodes.sum()):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {int(num_nodes.sum())} tree nodes")
    if not (len(params) == len(generators) == num_seqs):
        raise ValueError("params and generators must have one entry per request")
    rows, cols = _node_index(num_nodes)
    accept_len = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((num_seqs, max_nodes), -1, dtype=torch.int64, device=device)
    next_token = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    is_greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device)
    greedy, sampled = is_greedy.nonzero()[:, 0], (~is_greedy).nonzero()[:, 0]
    if len(greedy):
        # The same argmax plain greedy decoding takes (target_probs_from_logits is one-hot on it).
        target_argmax = torch.zeros_like(draft_tokens)  # [num_seqs, max_nodes]
        target_argmax[rows, cols] = argmax_rows(target_logits).to(device)
        # Greedy tree verification (SpecInfer's token-tree verifier at temperature 0): follow
        # the child whose token is the target's argmax at each node; the argmax at the last
        # accepted node is the next token, exactly as plain greedy decoding would produce it.
        result = ops.greedy_verify(draft_tokens[greedy], parents[greedy], num_nodes[greedy], target_argmax[greedy])
        accept_len[greedy], accepted_nodes[greedy], next_token[greedy] = result
    if len(sampled):
        result = _rejection_sample(sampled, draft_tokens, parents, num_nodes, rows, cols, target_logits,
                                   params, generators, draft_probs)
        accept_len[sampled], accepted_nodes[sampled], next_token[sampled] = result
    last = accepted_nodes.gather(1, accept_len[:, None])  # [num_seqs, 1]
    # The next token is recovered iff the last accepted node has children (they were all
    # rejected); at a leaf it is the bonus token.
    recovered = (parents == last).any(1)
    accepted_tokens = torch.where(accepted_nodes >= 0, draft_tokens.gather(1, accepted_nodes.clamp(min=0)), -1)
    return BatchVerdict(accept_len, accepted_nodes, accepted_tokens, next_token, recovered, num_nodes)


def _rejection_sample(
    sampled: torch.Tensor,  # [num_sampled] rows of the batch that sample
    draft_tokens: torch.Tensor,  # [num_seqs, max_nodes]
    parents: torch.Tensor,  # [num_seqs, max_nodes]
    num_nodes: torch.Tensor,  # [num_seqs]
    rows: torch.Tensor,  # [sum(num_nodes)] batch row of each flat node
    cols: torch.Tensor,  # [sum(num_nodes)] node index of each flat node
    target_logits: torch.Tensor,  # [sum(num_nodes), vocab]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None,  # [sum(num_nodes), vocab]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_seqs, max_nodes = draft_tokens.shape
    vocab, device = target_logits.shape[1], target_logits.device
    # batch row -> row among the sampled ones
    position = torch.full((num_seqs,), -1, dtype=torch.int64, device=device)
    position[sampled] = torch.arange(len(sampled), device=device)
    sub_rows = position[rows]  # [sum(num_nodes)], -1 for the nodes of greedy requests
    target_probs = torch.zeros(len(sampled), max_nodes, vocab, device=device)  # [num_sampled, max_nodes, vocab]
    # One target_probs_from_logits call per distinct SamplingParams (agents mostly share them).
    by_params: dict[SamplingParams, list[int]] = {}
    for seq in sampled.tolist():
        by_params.setdefault(params[seq], []).append(seq)
    for request_params, seqs in by_params.items():
        pick = sub_rows >= 0 if len(by_params) == 1 else torch.isin(rows, torch.tensor(seqs, device=device))
        target_probs[sub_rows[pick], cols[pick]] = target_probs_from_logits(target_logits[pick], request_params)
    packed_draft_probs = None
    if draft_probs is not None:
        pick = sub_rows >= 0
        # [num_sampled, max_nodes, vocab]
        packed_draft_probs = torch.zeros(len(sampled), max_nodes, vocab, device=device)
        packed_draft_probs[sub_rows[pick], cols[pick]] = draft_probs[pick].float()
    sub_num_nodes = num_nodes[sampled]
    # Drawn on the CPU from each request's CPU generator (the engine's), then moved.
    uniform, recovery_noise = _random_draws(sampled.tolist(), sub_num_nodes.tolist(), generators, max_nodes, vocab)
    uniform, recovery_noise = uniform.to(device), recovery_noise.to(device)
    # Recursive rejection sampling over the tree: SpecInfer's multi-step speculative sampling
    # (Miao et al. 2024, Alg. 2) generalising Leviathan et al. 2023 (Alg. 1, Thm. 1) from a chain
    # to siblings: child c with token t is accepted with prob min(1, target(t) / draft_c(t)); on
    # rejection the target becomes norm(max(target - draft_c, 0)) for the next sibling, and the
    # next token is sampled from whatever distribution the walk stops at (the residual:
    # recovered token; the target itself at a leaf: bonus token). One-hot drafts reduce this to
    # walking the siblings: accept t with prob target(t), else zero it out and renormalise.
    # Exact for any drafts, provided draft_probs row c is the distribution node c's token was
    # drawn from given the draws before it: the parent's draft distribution for i.i.d. siblings,
    # that distribution renormalised over the not-yet-drawn tokens for sampling without
    # replacement, one-hot for deterministic drafts.
    return ops.rejection_sample(draft_tokens[sampled], parents[sampled], sub_num_nodes, target_probs,
                                packed_draft_probs, uniform, recovery_noise)


def _walk_greedy(tree: DraftTree, best: list[int]) -> VerifyOutcome:
    """Greedy verification of one tree (kernels/reference.greedy_verify at one sequence): from
    the root, follow the lowest-index child whose token is the target's argmax at the current
    node (best[c]: the argmax of node c's row); the argmax where the walk stops is the next
    token, recovered if that node has children (all rejected), else the bonus."""
    children = tree.children
    cur, path = 0, [0]
    while True:
        want = best[cur]
        nxt = next((c for c in children[cur] if tree.tokens[c] == want), None)
        if nxt is None:
            break
        cur = nxt
        path.append(cur)
    return VerifyOutcome(tuple(path), tuple(tree.tokens[c] for c in path[1:]), best[cur],
                         RECOVERED if children[cur] else BONUS, tree.num_nodes - 1)


def _walk_one_hot(
    tree: DraftTree,
    logits: torch.Tensor,  # [num_nodes, vocab], CPU: the target's logits at the tree's nodes
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyOutcome:
    """Recursive rejection sampling of one sampled request's deterministic drafts, node by node
    (the rule of kernels/reference.rejection_sample at one sequence, one-hot drafts): at the
    current node its children are tried in order, child c accepted when u_c < residual[token_c],
    a rejected token's mass removed from the residual (renormalised); the walk stops at a node
    whose children are all rejected (the next token recovered from what is left) or at a leaf
    (the bonus, from the node's distribution). A node's target distribution is computed only
    when the walk reaches it, one row at a time. Draws: one uniform per node, then one that
    picks the last token by inverting the residual's CDF (sampler.inverse_cdf) -- the batch walk
    races one Exp(1) per vocabulary entry instead, ~0.4 ms of torch.rand a step for a 49k
    vocabulary; either is an exact sample of the residual."""
    n = tree.num_nodes
    draws = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()  # [c]: node c; [n]: the last token
    probs = lambda c: target_probs_from_logits(logits[c : c + 1], params)[0]  # noqa: E731  [vocab]
    children = tree.children
    cur, path, recovered = 0, [0], False
    residual = probs(0)
    while True:
        for c in children[cur]:
            token = tree.tokens[c]
            if draws[c] < float(residual[token]):  # reference: uniform * q < p, q = 1
                cur = c
                path.append(c)
                residual = probs(c)
                break
            leftover = residual.clone()
            leftover[token] = 0.0
            total = float(leftover.sum())
            if total > 0:
                residual = leftover / total
        else:  # no child accepted (or none at all): the walk stops here
            recovered = bool(children[cur])
            break
    token = inverse_cdf(residual, draws[n])
    return VerifyOutcome(tuple(path), tuple(tree.tokens[c] for c in path[1:]), token,
                         RECOVERED if recovered else BONUS, n - 1)


def _random_draws(
    seqs: list[int], num_nodes: list[int], generators: Sequence[torch.Generator | None],
    max_nodes: int, vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """uniform [len(seqs), max_nodes] (column c judges node c; column 0 unused) and
    recovery_noise [len(seqs), vocab], Exp(1). A request with a generator draws the noise
    first, then one uniform per draft node, so a 1-node tree consumes exactly what plain
    sampling does; requests without one draw together from the default generator."""
    uniform = torch.zeros(len(seqs), max_nodes)
    recovery_noise = torch.empty(len(seqs), vocab)
    own = [(i, generators[seq]) for i, seq in enumerate(seqs) if generators[seq] is not None]
    if len(own) < len(seqs):
        shared = torch.ones(len(seqs), dtype=torch.bool)
        shared[[i for i, _ in own]] = False
        recovery_noise[shared] = exponential_noise((len(seqs) - len(own), vocab), None)
        uniform[shared, 1:] = torch.rand(len(seqs) - len(own), max_nodes - 1)
    for i, generator in own:
        recovery_noise[i] = exponential_noise((1, vocab), generator)[0]
        uniform[i, 1 : num_nodes[i]] = torch.rand(num_nodes[i] - 1, generator=generator)
    return uniform, recovery_noise


def _node_index(num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, node index) of every flat node row, each [sum(num_nodes)] int64."""
    device = num_nodes.device
    rows = torch.repeat_interleave(torch.arange(len(num_nodes), device=device), num_nodes)
    starts = num_nodes.cumsum(0) - num_nodes
    return rows, torch.arange(len(rows), device=device) - starts[rows]


def verify_on_device(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [sum(num_nodes), vocab]: each tree's nodes, trees in order
    params: Sequence[SamplingParams],
    requests: Sequence,  # per tree its Request: the counter RNG's seed (rng_seed) and position
    path,  # runtime/step_path.DeviceStepPath: upload, keys, read
) -> list[VerifyOutcome]:
    """`verify` for the device path, with one device-to-host read. The trees' layout, the node
    rows and the counter-RNG keys go up in one non-blocking copy; greedy and sampled requests
    are decided on the device (the same kernel ops, no data-dependent shapes), and the verdict
    [num_seqs, 2 + max_nodes] (accept_len, next_token, accepted path) comes back in one read.
    The draws are runtime/counter_rng.py's at each request's position: the noise stream is the
    one plain device sampling uses at that position (so a 1-node tree emits what plain decoding
    would), one acceptance uniform per node (column c judges node c). Exact by the same
    argument as `verify`; one-hot (deterministic) drafts only."""
    from prescient.runtime.counter_rng import NOISE, UNIFORM, counter_exponential, counter_uniform

    num_seqs = len(trees)
    sizes = [t.num_nodes for t in trees]
    max_nodes = max(sizes, default=1)
    pad = lambda xs, n: [*xs, *(-1,) * (max_nodes - n)]  # noqa: E731
    draft_flat = [x for t in trees for x in pad(t.tokens, t.num_nodes)]
    parents_flat = [x for t in trees for x in pad(t.parents, t.num_nodes)]
    # where each flat logits row sits in the [num_seqs, max_nodes] layout
    node_slot = [s * max_nodes + c for s, n in enumerate(sizes) for c in range(n)]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    groups: dict[SamplingParams, list[int]] = {}  # sampled requests by params
    for i in sampled:
        groups.setdefault(params[i], []).append(i)
    order = [i for seqs in groups.values() for i in seqs]  # sampled requests, group by group
    starts, row = [], 0
    for n in sizes:
        starts.append(row)
        row += n
    # per group: the flat logits rows of its nodes and their slots in the sampled layout
    group_rows = [[starts[i] + c for i in seqs for c in range(sizes[i])] for seqs in groups.values()]
    position = {i: k for k, i in enumerate(order)}
    group_slots = [[position[i] * max_nodes + c for i in seqs for c in range(sizes[i])] for seqs in groups.values()]
    chosen = [requests[i] for i in order]
    parts = [draft_flat, parents_flat, sizes, node_slot, order,
             path.keys(chosen, NOISE), path.keys(chosen, UNIFORM),
             *(x for pair in zip(group_rows, group_slots) for x in pair)]
    dev = path.upload(parts)
    draft_tokens = dev[0].view(num_seqs, max_nodes)
    parents = dev[1].view(num_seqs, max_nodes)
    num_nodes, node_slot_t, order_t = dev[2], dev[3], dev[4]
    noise_keys, uniform_keys = dev[5].view(-1, 2), dev[6].view(-1, 2)
    vocab, device = target_logits.shape[1], target_logits.device
    accept_len = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((num_seqs, max_nodes), -1, dtype=torch.int64, device=device)
    next_token = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    if greedy:
        # argmax at every node (all requests: a sampled one's rows are simply overwritten below)
        target_argmax = torch.zeros(num_seqs * max_nodes, dtype=torch.int64, device=device)
        target_argmax[node_slot_t] = target_logits.argmax(-1)
        accept_len, accepted_nodes, next_token = ops.greedy_verify(
            draft_tokens, parents, num_nodes, target_argmax.view(num_seqs, max_nodes))
    if sampled:
        num_sampled = len(order)
        target_probs = torch.zeros(num_sampled * max_nodes, vocab, device=device)  # [num_sampled * max_nodes, vocab]
        for k, request_params in enumerate(groups):
            rows_t, slots_t = dev[7 + 2 * k], dev[8 + 2 * k]
            target_probs[slots_t] = target_probs_from_logits(target_logits[rows_t], request_params)
        uniform = counter_uniform(uniform_keys, max_nodes)  # [num_sampled, max_nodes]
        recovery_noise = counter_exponential(noise_keys, vocab)  # [num_sampled, vocab]
        s_len, s_nodes, s_next = ops.rejection_sample(
            draft_tokens[order_t], parents[order_t], num_nodes[order_t],
            target_probs.view(num_sampled, max_nodes, vocab), None, uniform, recovery_noise)
        if greedy:
            accept_len[order_t], accepted_nodes[order_t], next_token[order_t] = s_len, s_nodes, s_next
        else:
            accept_len, accepted_nodes, next_token = s_len, s_nodes, s_next
    verdict = path.read(torch.cat([accept_len[:, None], next_token[:, None], accepted_nodes], 1))
    outcomes = []
    for tree, (n, token, *nodes) in zip(trees, verdict):
        path_nodes = tuple(nodes[:n + 1])
        last = path_nodes[-1]
        recovered = any(p == last for p in tree.parents[1:])  # its children were all rejected
        outcomes.append(VerifyOutcome(path_nodes, tuple(tree.tokens[c] for c in path_nodes[1:]), token,
                                      RECOVERED if recovered else BONUS, tree.num_nodes - 1))
    return outcomes
