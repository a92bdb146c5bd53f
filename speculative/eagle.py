"""EAGLE proposer: draft trees from a trained head over the target's own features.

Per request it keeps what the head needs (speculative/eagle_head.py): the target's features
f_t at committed positions (handed over by the speculator after each forward: a chunk's rows,
a verify's root and accepted rows) and the head's K/V rows, row t computed from (embed(x_{t+1}),
f_t). One `propose` per request:

1. catch-up: head rows for positions whose feature and next token are now known (the last step's
   accepted tokens, or a prompt's last `catch_up` positions) in one head call; the last row
   (t = root - 1) predicts f^_root and the root's children;
2. expansion (EAGLE-2's dynamic tree, draft_tree_expand.DynamicTree): one head call per depth
   over the frontier nodes, each row (embed(its token), its parent's f^) attending to the
   committed rows and its ancestors' rows (kept for this proposal only);
3. the `budget` best nodes form the tree. The drafts are the head's top-k (deterministic), so
   verification uses the exact one-hot rule: lossless for greedy and sampled requests.

With an n-gram proposer beside it (`EagleConfig.ngram`), a request whose text the n-gram index
matches for at least `ngram_min_match` tokens (a copy in progress: tool output, an edited file)
takes the n-gram tree: copying beats a one-layer head where it applies. A shorter match's best
chain (up to `ngram_share` of the budget) and the head's best nodes share one tree
(`DynamicTree.build(first=...)`), so one verify checks both guesses; with no match the head's
tree alone.

Features arrive only for tokens the target computed: a cached prefix has none, so the head's rows
start where features start (the head attends to what it has); a step with no feature for the
position before the root (the first step after a handoff) gets the n-gram tree if any, else no
draft.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prescient.runtime.linear import QuantizedLinear, QuantWeight, make_linear
from prescient.speculative.draft_tree_expand import DynamicTree
from prescient.speculative.eagle_head import HeadRunner, default_head_path, load_head, target_fingerprint
from prescient.speculative.proposer import ProposalContext, register_proposer
from prescient.speculative.tree import DraftTree


@dataclass(frozen=True)
class EagleConfig:
    target_model: object  # the LlamaModel the head was trained on (its embeddings, LM head, norm)
    head_path: str | None = None  # None: default_head_path(the target's fingerprint)
    max_depth: int = 6
    top_k: int = 4  # children per expanded node, nodes expanded per depth
    max_draft_tokens: int = 12  # node budget; each context's max_draft_tokens caps it further
    catch_up: int = 256  # most head rows computed for a context at once (a long prompt's tail)
    max_context: int = 2048  # head rows kept per request (older ones dropped)
    ngram: object | None = None  # an NgramProposer to take copies (None: the head alone)
    ngram_min_match: int = 4  # a match this long takes the n-gram tree alone
    # a shorter match's best chain joins the head's tree, up to this share of the budget (the
    # head's nodes fill the rest; one verify checks both guesses)
    ngram_share: float = 0.5


# heads shipped with the package, named as in the cache folder
SHIPPED = Path(__file__).resolve().parent / "heads"


def head_path_for(model) -> str:
    """The head file a target uses: its trained head in the cache folder (`prescient
    train-head` writes it there) if any, else a shipped one, else the cache path (absent)."""
    cached = default_head_path(fingerprint(model))
    shipped = SHIPPED / cached.name
    return str(cached if cached.exists() or not shipped.exists() else shipped)


def has_head(model) -> bool:
    return os.path.exists(head_path_for(model))


def fingerprint(model) -> str:
    """The target's identity a head is checked against (eagle_head.target_fingerprint)."""
    row = model.embed_tokens(torch.tensor([1], device=model.device))[0]
    return target_fingerprint(model.config, row.float().cpu())


def lm_head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows for `ids` [n] -> [n, hidden] fp32 (blocks dequantized)."""
    head = model.lm_head
    head = getattr(head, "inner", head)
    if hasattr(head, "lookup"):
        return head.lookup(ids, torch.float32)
    return head.weight[ids].float()


def draft_lm_head(model, ids: torch.Tensor):
    """The draft LM head: the target's LM head rows for `ids` [n] in their own format (a
    quantized head's block rows as they are: the target's arithmetic, a fraction of the bytes),
    as a linear [hidden] -> [n]."""
    head = getattr(model.lm_head, "inner", model.lm_head)
    q = getattr(head, "qweight", None)
    if q is not None:
        return QuantizedLinear(QuantWeight(q.blocks[ids].contiguous(), q.qtype, (len(ids), q.shape[1])))
    return make_linear(head.weight[ids].contiguous())


def _first_path(tree: DraftTree) -> list[int]:
    """The tokens along a tree's first children from the root (its best guess)."""
    out, cur = [], 0
    for i in range(1, tree.num_nodes):  # parents come first: the first child of cur is the next i below it
        if tree.parents[i] == cur:
            out.append(tree.tokens[i])
            cur = i
    return out


@dataclass
class _State:
    start: int = 0  # position of the first kept feature / head row
    feats: torch.Tensor | None = None  # [cap, hidden] fp32, positions start..start+num_feats-1
    num_feats: int = 0
    k: torch.Tensor | None = None  # [kv, cap] head rows t = start..start+num_rows-1, transposed
    v: torch.Tensor | None = None  # [cap, kv]
    num_rows: int = 0
    row_tokens: list[int] = field(default_factory=list)  # x_{t+1} of each head row


def _grow(t: torch.Tensor | None, need: int, width: int) -> torch.Tensor:
    if t is not None and t.shape[0] >= need:
        return t
    cap = max(64, need, 2 * (t.shape[0] if t is not None else 0))
    out = torch.empty(cap, width, dtype=torch.float32)
    if t is not None:
        out[:t.shape[0]] = t
    return out


class EagleProposer:
    wants_hidden = True  # the speculator hands it the target's hidden states (on_features)
    drafts_past_unverified = False  # a forced span has no features yet

    def __init__(self, config: EagleConfig):
        self.config = config
        model = config.target_model
        if not isinstance(getattr(model, "keep_hidden", None), bool):  # a TP model's ranks hold the rows
            raise ValueError(f"an EAGLE head needs a model that keeps its hidden states, not a {type(model).__name__}")
        path = config.head_path or head_path_for(model)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no EAGLE head at {path}; train one with `prescient train-head`")
        head, self.meta = load_head(path, model.config)
        want = fingerprint(model)
        if head.cfg.target != want:
            raise ValueError(f"the head at {path} was trained for {head.cfg.target}, not this model ({want})")
        self.model = model
        self.runner = HeadRunner(head, draft_lm_head(model, head.draft_ids))
        self.path = path
        self._states: dict[str, _State] = {}
        self.ngram = config.ngram
        self.num_ngram_trees = 0  # which proposer drafted: for the stats and the tests
        self.num_head_trees = 0

    # -------------------------------------------------------------- features in

    def on_features(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, hidden] (before its final norm) of positions
        start..start+n-1, just computed."""
        n = hidden.shape[0]
        if n == 0:
            return
        st = self._states.setdefault(request_id, _State(start=start))
        end = st.start + st.num_feats
        if st.num_feats == 0 or start > end or start < st.start:  # a gap (or a restart): begin again
            st.start, st.num_feats, st.num_rows, st.row_tokens = start, 0, 0, []
            end = start
        keep = start - st.start  # features kept before this batch (a recompute overwrites)
        st.feats = _grow(st.feats, keep + n, hidden.shape[1])
        st.feats[keep:keep + n] = self.model.features(hidden)
        st.num_feats = keep + n
        if st.num_rows > keep:  # rows built on overwritten features
            st.num_rows = keep
            del st.row_tokens[keep:]
        # past max_context, drop a quarter at once: a drop copies the buffers
        over = st.num_feats - self.config.max_context
        if over > 0:
            self._drop_front(st, over + self.config.max_context // 4)

    def _drop_front(self, st: _State, n: int) -> None:
        st.feats = st.feats[n:st.num_feats].clone()
        st.num_feats -= n
        d = min(n, st.num_rows)
        if st.k is not None:
            st.k, st.v = st.k[:, d:st.num_rows].clone(), st.v[d:st.num_rows].clone()
        st.num_rows -= d
        del st.row_tokens[:d]
        st.start += n

    # -------------------------------------------------------------- proposing

    def propose(self, contexts: Sequence[ProposalContext]) -> list[DraftTree | None]:
        return [self._propose_one(ctx) for ctx in contexts]

    def _propose_one(self, ctx: ProposalContext) -> DraftTree | None:
        budget = min(ctx.max_draft_tokens, self.config.max_draft_tokens)
        if budget <= 0:
            return None
        copy = None  # a short n-gram match's tree: its best chain joins the head's tree
        if self.ngram is not None:
            copy = self.ngram.propose([ProposalContext(ctx.request_id, ctx.session_id, ctx.token_ids, budget,
                                                       ctx.tenant)])[0]
            if copy is not None and self.ngram.last_match_len(ctx.request_id) >= self.config.ngram_min_match:
                self.num_ngram_trees += 1
                return copy
        st = self._states.get(ctx.request_id)
        root = len(ctx.token_ids) - 1  # the root's position
        if st is None or st.start + st.num_feats < root or root - 1 < st.start:
            self.num_ngram_trees += copy is not None
            return copy  # no feature for the position before the root
        f_root = self._catch_up(st, ctx.token_ids, root)
        chain = _first_path(copy)[:int(budget * self.config.ngram_share)] if copy is not None else []
        tree = self._expand(st, ctx.token_ids[-1], root, f_root, budget, chain)
        self.num_head_trees += tree is not None
        return tree

    def _catch_up(self, st: _State, tokens: Sequence[int], root: int):
        """Head rows up to t = root - 1; -> (f^_root [1, hidden], draft logits [1, V]) of the
        last."""
        r = self.runner
        # rows built from tokens the context no longer has (a rewritten context) go
        lo = st.start + 1
        if st.row_tokens and st.row_tokens != list(tokens[lo:lo + st.num_rows]):
            st.num_rows, st.row_tokens = 0, []
        first, last = st.start + st.num_rows, root - 1  # rows t = first..last are missing
        if last - first + 1 > self.config.catch_up:  # a long prompt: only its tail
            skip = last - self.config.catch_up + 1 - st.start
            self._drop_front(st, skip)
            first = st.start
        if first > last:  # nothing new (the same context proposed twice): redo the last row
            st.num_rows -= 1
            st.row_tokens.pop()
            first = last
        n = last - first + 1
        ids = torch.tensor(list(tokens[first + 1:last + 2]), dtype=torch.int64)
        feats = st.feats[first - st.start:last - st.start + 1]
        positions = torch.arange(first, last + 1)
        past = st.num_rows
        self._reserve_rows(st, past + n)  # (the tree's rows go after these: _expand grows as it needs)
        h, logits = r.step_at(self.model.embed_tokens(ids), feats, positions, st.k, st.v, past, past, None,
                              logits_rows=[n - 1])
        st.num_rows += n
        st.row_tokens += ids.tolist()
        return h[n - 1:n], logits

    def _expand(self, st: _State, root_token: int, root: int, start, budget: int,
                chain: Sequence[int] = ()) -> DraftTree | None:
        cfg, r = self.config, self.runner
        f_root, logits = start
        tree = DynamicTree(root_token, budget, cfg.max_depth, cfg.top_k)
        self._add_children(tree, [0], logits)
        out_feat = {0: f_root[0]}  # node -> f^ its children's rows read
        node_row: dict[int, int] = {}  # node -> its row among the tree's (after the committed rows)
        past = st.num_rows
        while True:
            frontier = tree.frontier()
            if not frontier:
                break
            n, held = len(frontier), len(node_row)  # tree rows so far
            ids = torch.tensor([tree.tokens[x] for x in frontier], dtype=torch.int64)
            feats = torch.stack([out_feat[tree.parents[x]] for x in frontier])
            positions = torch.tensor([root + tree.depths[x] - 1 for x in frontier])
            marks = [[False] * (held + n) for _ in frontier]  # its ancestors' rows and its own
            for j, x in enumerate(frontier):
                a = tree.parents[x]
                while a > 0:
                    marks[j][node_row[a]] = True
                    a = tree.parents[a]
                marks[j][held + j] = True
            self._reserve_rows(st, past + held + n)
            h, logits = r.step_at(self.model.embed_tokens(ids), feats, positions, st.k, st.v, past + held, past,
                                  torch.tensor(marks, dtype=torch.bool))
            for j, x in enumerate(frontier):
                node_row[x] = held + j
                out_feat[x] = h[j]
            self._add_children(tree, frontier, logits)
        built = tree.build(chain)
        return built if built.num_nodes > 1 else None

    def _reserve_rows(self, st: _State, rows: int) -> None:
        """Head K/V buffers of at least `rows` positions (the committed ones kept)."""
        kv = self.runner.kv_size
        st.v = _grow(st.v, rows, kv)
        if st.k is None or st.k.shape[1] < st.v.shape[0]:  # K transposed: positions are columns
            k = torch.empty(kv, st.v.shape[0], dtype=torch.float32)
            if st.k is not None:
                k[:, :st.k.shape[1]] = st.k
            st.k = k

    def _add_children(self, tree: DynamicTree, nodes: list[int], logits: torch.Tensor) -> None:
        """logits: [len(nodes), draft_vocab] -> each node's top-k children (target ids)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        top_lp, top_idx = logprobs.topk(tree.top_k, dim=-1)
        tree.expand(nodes, self.runner.draft_ids[top_idx], top_lp)

    # -------------------------------------------------------------- lifecycle

    def on_tokens_appended(self, request_id: str, session_id: str | None, token_ids: Sequence[int]) -> None:
        if self.ngram is not None:
            self.ngram.on_tokens_appended(request_id, session_id, token_ids)

    def on_request_finished(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        if self.ngram is not None:
            self.ngram.on_request_finished(request_id)

    def on_session_closed(self, session_id: str) -> None:
        if self.ngram is not None:
            self.ngram.on_session_closed(session_id)

    def learn_output(self, tenant: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        learn = getattr(self.ngram, "learn_output", None)
        if learn is not None:
            learn(tenant, prompt, output)


@register_proposer("eagle")
def _make_eagle(config: EagleConfig | None) -> EagleProposer:
    if config is None:
        raise ValueError("the eagle proposer needs an EagleConfig (its target model)")
    return EagleProposer(config)
