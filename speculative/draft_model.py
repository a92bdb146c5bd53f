"""Draft-model proposer: a small causal LM (or the target's own first layers) guesses ahead.

The draft is any `LlamaModel` sharing the target's tokenizer; with none given, the
self-speculative early-exit draft `target.early_exit(n)`: the target's first n layers, final norm
and LM head, sharing its weights (no extra memory); or `self_quantized_draft`: the target's own
full depth with its linears quantized at load (`--draft-model self-int4|self-int8`), worth it for
a float (bf16) target, pointless for one already held in blocks as small.

Data flow of one `propose` over a batch of requests:
1. Catch-up: the draft has its own paged KV (its own `BlockManager` and KV tensors). Per
   request it remembers which token ids its KV holds at positions 0..len-1; the longest common
   prefix with `context.token_ids` is kept and the rest (the prompt at first, then the bonus
   token and whatever the draft had not computed) runs in one batched causal forward, ending at
   the root (the last verified token), whose logits start the tree.
2. Expansion (`draft_tree_expand.DynamicTree`, EAGLE-2's dynamic tree): one batched draft
   forward per depth over every request's frontier nodes, with tree attention. The kernel's mask
   covers only a forward's own new tokens and every query sees all earlier KV positions, so a
   forward recomputes each frontier node's ancestors too (a few rows; on a bandwidth-bound CPU
   extra rows are nearly free, and logits, the LM head being the costly part, are taken only for
   the frontier). Rows sit at KV positions `prefix_len + 1 + row` (after the root at
   `prefix_len`), RoPE positions `prefix_len + depth`: the layout of docs/CONTRACTS.md. Leading
   rows the previous depth left in place and every later row descends from are not recomputed
   (`_held_rows`): a chain forwards one row per depth (at batch 1 rows are not free: every
   extra one is measurable on 2 cores).
3. The best `budget` nodes form the `DraftTree`. The first forwarded path sits at its true
   positions, so its KV counts as held: accepted draft tokens need no recompute next step.

Drafts are chosen deterministically (greedy / top-k), so the verifier must use the exact one-hot
rule (`verify(..., draft_probs=None)`): lossless for greedy requests (target argmax) and for
sampled ones alike (recursive rejection with one-hot drafts keeps the target distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prescient.kernels.reference import pack_bits
from prescient.runtime.batch import SeqRows, pack_forward_batch
from prescient.runtime.kv_cache import BlockManager
from prescient.runtime.linear import QuantWeight
from prescient.runtime.loader import QUANTIZE, ModelLoadError, load_checkpoint
from prescient.runtime.model import LlamaModel
from prescient.speculative.draft_tree_expand import DynamicTree
from prescient.speculative.proposer import ProposalContext, register_proposer
from prescient.speculative.tree import DraftTree


@dataclass(frozen=True)
class DraftModelConfig:
    """Which draft, its KV size, and the tree shape. Give `draft_model`, or `target_model` (with
    `early_exit_layers`) for the early-exit draft."""

    draft_model: LlamaModel | None = None
    target_model: LlamaModel | None = None  # also bounds draft token ids to the target's vocab
    early_exit_layers: int | None = None  # None: a quarter of the target's layers
    max_depth: int = 4  # deepest draft token
    top_k: int = 1  # children per expanded node and nodes expanded per depth; 1 = chain drafting
    max_draft_tokens: int = 8  # node budget; each context's max_draft_tokens caps it further
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20  # the draft's KV pool...
    num_blocks: int | None = None  # ...or exactly this many blocks
    max_context_len: int | None = None  # per request; longer contexts get no proposal (None: pool/model limit)
    max_batched_tokens: int = 512  # catch-up rows per forward (a long prompt is chunked)

    def __post_init__(self) -> None:
        if self.draft_model is None and self.target_model is None:
            raise ValueError("a draft proposer needs draft_model, or target_model for the early-exit draft")
        for name in ("max_depth", "top_k", "max_draft_tokens", "block_size", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.draft_model is not None and self.early_exit_layers is not None:
            raise ValueError("early_exit_layers builds a draft from target_model; not with draft_model")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    def early_exit_depth(self) -> int:
        """The early-exit draft's layers: early_exit_layers, else a quarter of the target's (>= 1)."""
        assert self.target_model is not None
        return self.early_exit_layers or max(1, self.target_model.num_layers // 4)

    def build_draft(self) -> LlamaModel:
        """The draft model, or the target's early-exit draft (its `early_exit`, the one constructor)."""
        if self.draft_model is not None:
            return self.draft_model
        return self.target_model.early_exit(self.early_exit_depth())


@dataclass
class _RequestKV:
    block_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is valid at positions 0..len-1: the context of the last step, then perhaps
    # the first draft path of that step.
    token_ids: list[int] = field(default_factory=list)
    num_committed: int = 0  # how many of token_ids were that context


def _common_prefix(kv: _RequestKV, token_ids: Sequence[int]) -> int:
    """How many leading positions of the draft's KV stay valid for `token_ids` (never the last
    token: its logits are needed, so the root is always recomputed)."""
    limit = min(len(kv.token_ids), len(token_ids) - 1)
    # The engine only appends to a context: one C-level slice comparison settles the committed
    # part, and only the last step's draft path is walked token by token.
    common = min(kv.num_committed, limit)
    if kv.token_ids[:common] != list(token_ids[:common]):
        common = 0  # a rewritten context: find the divergence from the start
    while common < limit and kv.token_ids[common] == token_ids[common]:
        common += 1
    return common


def _held_rows(kv: _RequestKV, token_ids: Sequence[int], in_place: list[int], attend: torch.Tensor) -> int:
    """How many leading rows of a depth forward need no recompute: in-place path rows whose KV
    the previous depth's forward left valid, and which every later row descends from (a row
    past them sees all earlier KV positions, so none may be a sibling's). A chain forwards only
    its new node; each recomputed row is a full pass over the draft's weights' arithmetic.
    attend: [num_rows, num_rows] bool."""
    num_tokens, skip = len(token_ids), 0
    limit = min(len(in_place), len(kv.token_ids) - num_tokens, attend.shape[0] - 1)
    while skip < limit and kv.token_ids[num_tokens + skip] == in_place[skip]:
        skip += 1
    while skip and not bool(attend[skip:, skip - 1].all()):
        skip -= 1  # a later row is not its descendant: it would see that row's KV
    return skip


@dataclass
class _Rows:
    """One sequence's rows of a draft forward (`_forward` turns it into the builder's `SeqRows`)."""

    kv: _RequestKV
    input_ids: list[int]
    positions: list[int]  # RoPE positions
    start: int  # KV position of the first row; row r writes position start + r
    attend: torch.Tensor | None  # [num_rows, num_rows] bool among these rows, None = causal
    logits_rows: list[int]  # rows whose logits come back, in order


class DraftModelProposer:
    """Proposes EAGLE-2 dynamic draft trees (chains when top_k == 1) from a draft model."""

    def __init__(self, config: DraftModelConfig) -> None:
        self.config = config
        self.model = config.build_draft()
        self.vocab_limit = self.model.config.vocab_size
        if config.target_model is not None:
            self.vocab_limit = min(self.vocab_limit, config.target_model.config.vocab_size)
        block_size = config.block_size
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_bytes // (self.model.kv_bytes_per_token() * block_size))
        self.kv_caches = self.model.allocate_kv_cache(num_blocks, block_size)
        # No prefix caching: a draft block is only ever read by its own request.
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.max_context_len = min(config.max_context_len or num_blocks * block_size, num_blocks * block_size)
        self._requests: dict[str, _RequestKV] = {}
        self.num_forwards = 0  # draft forwards run (catch-up chunks + expansion depths)
        self.num_catch_up_tokens = 0  # context tokens the draft computed (not held in its KV)

    # ---------------------------------------------------------------- Proposer protocol

    def propose(self, contexts: Sequence[ProposalContext]) -> list[DraftTree | None]:
        results: list[DraftTree | None] = [None] * len(contexts)
        work: list[tuple[int, ProposalContext, _RequestKV, DynamicTree]] = []
        for i, ctx in enumerate(contexts):
            budget = min(ctx.max_draft_tokens, self.config.max_draft_tokens)
            if budget < 1 or not ctx.token_ids:
                continue
            tree = DynamicTree(int(ctx.token_ids[-1]), budget, self.config.max_depth, self.config.top_k)
            kv = self._reserve(ctx.request_id, len(ctx.token_ids), tree.top_k, tree.max_depth)
            if kv is not None:
                work.append((i, ctx, kv, tree))
        if not work:
            return results
        root_logits = self._catch_up([(ctx.token_ids, kv) for _, ctx, kv, _ in work])  # [len(work), vocab]
        top_tokens, top_logprobs = self._top_k(root_logits)
        for r, (_, _, _, tree) in enumerate(work):
            tree.expand([0], top_tokens[r:r + 1], top_logprobs[r:r + 1])
        self._expand([(ctx, kv, tree) for _, ctx, kv, tree in work])
        for i, _, _, tree in work:
            results[i] = tree.build()
        return results

    def on_tokens_appended(self, request_id: str, session_id: str | None, token_ids: Sequence[int]) -> None:
        """Bring the draft's KV up to `token_ids` now (after prefill: the draft's own pass over
        the prompt leaves the first decode step). Optional: propose() catches up by itself."""
        config = self.config
        kv = self._reserve(request_id, len(token_ids), min(config.top_k, config.max_draft_tokens),
                           min(config.max_depth, config.max_draft_tokens))
        if kv is not None and len(token_ids) > 1:
            self._catch_up([(token_ids, kv)], want_logits=False)

    def on_request_finished(self, request_id: str) -> None:
        kv = self._requests.pop(request_id, None)
        if kv is not None:
            self.block_manager.free_blocks(kv.block_ids)

    def on_session_closed(self, session_id: str) -> None:
        """Nothing kept per session: draft KV lives and dies with its request."""

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---------------------------------------------------------------- KV bookkeeping

    def _reserve(self, request_id: str, num_tokens: int, top_k: int, max_depth: int) -> _RequestKV | None:
        """The request's KV state with blocks for its context plus one tree's rows, or None (no
        proposal this step) when it does not fit."""
        # A depth forward holds the paths to at most top_k frontier nodes, plus the greedy one
        # when it ranks below them (a chain's only node is the greedy one), each at most
        # max_depth - 1 deep (the last depth is never forwarded).
        max_rows = (top_k + (top_k > 1)) * (max_depth - 1)
        needed = num_tokens + max_rows
        # RoPE tables end at max_position_embeddings; the deepest row sits at num_tokens - 2 + max_depth.
        if needed > self.max_context_len or num_tokens + max_depth > self.model.config.max_position_embeddings:
            # Over capacity: drop its KV rather than grow without bound; it decodes plainly.
            self.on_request_finished(request_id)
            return None
        kv = self._requests.get(request_id)
        if kv is None:
            kv = self._requests[request_id] = _RequestKV()
        missing = -(-needed // self.block_manager.block_size) - len(kv.block_ids)
        if missing > 0:
            if not self.block_manager.can_allocate(missing):
                return None  # pool full: this request decodes plainly until blocks free up
            kv.block_ids += self.block_manager.allocate(missing)
        return kv

    def _catch_up(self, requests: list[tuple[Sequence[int], _RequestKV]],
                  want_logits: bool = True) -> torch.Tensor | None:
        """Compute the tokens (of each (token_ids, kv)) that the KV lacks, in as few causal
        forwards as max_batched_tokens allows. -> the last token's logits [len(requests), vocab]."""
        pending = []  # [request index, next position, end]
        for i, (token_ids, kv) in enumerate(requests):
            pending.append([i, _common_prefix(kv, token_ids), len(token_ids)])
        root_logits: list[torch.Tensor | None] = [None] * len(requests)
        while pending:
            room = self.config.max_batched_tokens
            seqs, finishing = [], []
            for item in pending:
                i, start, end = item
                take = min(end - start, room)
                if take == 0:
                    break
                room -= take
                self.num_catch_up_tokens += take
                ids = [int(t) for t in requests[i][0][start:start + take]]
                done = start + take == end and want_logits
                seqs.append(_Rows(requests[i][1], ids, list(range(start, start + take)), start, None,
                                  [take - 1] if done else []))
                if done:
                    finishing.append(i)
                item[1] = start + take
            for i, logits in zip(finishing, self._forward(seqs)):
                root_logits[i] = logits
            pending = [item for item in pending if item[1] < item[2]]
        for token_ids, kv in requests:
            kv.token_ids = list(token_ids)
            kv.num_committed = len(kv.token_ids)
        return torch.stack(root_logits) if want_logits else None  # type: ignore[arg-type]

    # ---------------------------------------------------------------- tree expansion

    def _expand(self, requests: list[tuple[ProposalContext, _RequestKV, DynamicTree]]) -> None:
        """EAGLE-2 expansion: one batched forward per depth over every request's frontier."""
        while True:
            seqs, frontiers, held = [], [], []
            for ctx, kv, tree in requests:
                frontier = tree.frontier()
                if not frontier:
                    continue
                rows, attend = tree.rows(frontier)
                num_tokens = len(ctx.token_ids)
                # The first rows that continue the root one depth at a time hold valid causal KV
                # at their true positions; everything after them is scratch.
                in_place = []
                for r, node in enumerate(rows):
                    if tree.depths[node] != r + 1 or (r and tree.parents[node] != rows[r - 1]):
                        break
                    in_place.append(tree.tokens[node])
                skip = _held_rows(kv, ctx.token_ids, in_place, attend)
                row_of = {node: r - skip for r, node in enumerate(rows)}
                # one row left (a chain's new node) is plain causal attention
                mask = attend[skip:, skip:].contiguous() if len(rows) - skip > 1 else None
                seqs.append(_Rows(kv, [tree.tokens[n] for n in rows[skip:]],
                                  [num_tokens - 1 + tree.depths[n] for n in rows[skip:]],
                                  num_tokens + skip, mask, [row_of[n] for n in frontier]))
                frontiers.append((tree, frontier))
                held.append((kv, [*ctx.token_ids, *in_place]))
            if not seqs:
                return
            top_tokens, top_logprobs = self._top_k(self._forward(seqs))  # [sum(len(frontier)), top_k]
            for kv, token_ids in held:
                kv.token_ids = token_ids
            row = 0
            for tree, frontier in frontiers:
                rows = slice(row, row + len(frontier))
                tree.expand(frontier, top_tokens[rows], top_logprobs[rows])
                row += len(frontier)

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [num_rows, vocab] -> (tokens, draft log-probs), each [num_rows, top_k], best
        first (a tree with a smaller budget uses the first few)."""
        logprobs = torch.log_softmax(logits[:, : self.vocab_limit].double(), dim=-1)
        values, tokens = torch.topk(logprobs, min(self.config.top_k, self.vocab_limit), dim=-1)
        return tokens, values

    # ---------------------------------------------------------------- one draft forward

    def _forward(self, seqs: list[_Rows]) -> torch.Tensor:
        """Run the draft over the rows of several sequences. -> logits [num_logits, vocab] for
        each sequence's logits_rows, sequences in order."""
        rows = [SeqRows(s.input_ids, s.positions, s.start, s.kv.block_ids,
                        None if s.attend is None else pack_bits(s.attend),  # [num_rows, ceil(num_rows / 32)]
                        s.logits_rows) for s in seqs]
        batch = pack_forward_batch(rows, self.block_manager.block_size, self.model.device)
        self.num_forwards += 1
        return self.model.forward(batch, self.kv_caches)


def draft_config_for(target, tokenizer=None, draft_model_path: str | None = None, **overrides) -> DraftModelConfig:
    """The config `--speculate draft [--draft-model PATH]` runs with: the checkpoint at PATH,
    loaded like the `target` model (same dtype and device), or without one the target's
    early-exit draft. A draft must share the target's `tokenizer`: ids are compared, not text."""
    if draft_model_path is None:
        return DraftModelConfig(target_model=target, **overrides)
    ckpt = load_checkpoint(draft_model_path)
    if tokenizer is not None:
        from prescient.runtime.tokenizer import Tokenizer

        draft_vocab = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file).hf
        target_vocab = tokenizer.hf
        ids = list(range(min(len(draft_vocab), len(target_vocab))))
        same = sum(a == b for a, b in zip(draft_vocab.convert_ids_to_tokens(ids),
                                          target_vocab.convert_ids_to_tokens(ids)))
        # Allow a few special tokens to differ (chat markers named differently); not the vocabulary.
        if same < 0.99 * max(len(draft_vocab), len(target_vocab)):
            raise ModelLoadError(f"draft model {draft_model_path} does not share the target's tokenizer "
                                 f"({same} of {len(target_vocab)} token ids agree)")
    draft = LlamaModel(ckpt.config, ckpt.weights, dtype=target.dtype, device=target.device)
    return DraftModelConfig(draft_model=draft, target_model=target, **overrides)


# `--draft-model` names that are not paths: the target's own weights quantized at load
SELF_DRAFTS = {"self-int4": "int4", "self-int8": "int8"}
_HEAD_QTYPE = "q8_0"  # the draft's embedding / LM head: int8 keeps its argmax close at half bf16's bytes


def _layer_linear_bytes(weights: dict) -> tuple[int, int]:
    """(bytes, weights) over the layers' linear matrices of a canonical weights dict."""
    nbytes = count = 0
    for name, w in weights.items():
        if name.startswith("layers.") and name.rsplit(".", 1)[1] in ("q", "k", "v", "o", "gate", "up", "down"):
            n, k = w.shape
            nbytes += w.blocks.nbytes if isinstance(w, QuantWeight) else w.nbytes
            count += n * k
    return nbytes, count


def self_quantized_draft(target: LlamaModel, weights: dict, name: str) -> LlamaModel:
    """The draft `--draft-model self-int4|self-int8` names: the target's full depth built from its
    own canonical `weights` (the dict it was built from), every layer linear quantized to
    QUANTIZE[...] blocks and the embedding / LM head to q8_0. The target's float tensors are
    quantized directly; blocks (a Q8_0 target under self-int4) are dequantized first. Refused
    when the copy's linears would not be clearly smaller than the target's (a Q4_1 target's
    int4 copy is the target itself: drafting with it can only cost)."""
    from prescient.kernels.quant_reference import QTYPES
    from prescient.kernels.quant_reference import quantize as quantize_blocks
    from prescient.runtime.loader import quantize_linears

    if name not in SELF_DRAFTS:
        raise ValueError(f"self-quantized drafts are {', '.join(SELF_DRAFTS)}, not {name!r}")
    quantize = SELF_DRAFTS[name]
    _, block_elems, block_bytes = QTYPES[QUANTIZE[quantize]]
    target_bytes, count = _layer_linear_bytes(weights)
    draft_bytes = count * block_bytes // block_elems
    if draft_bytes > 0.8 * target_bytes:
        raise ModelLoadError(
            f"--draft-model {name}: the target's layer weights are already {8 * target_bytes / count:.1f} bits per "
            f"weight ({target.weights_description()}); a {QUANTIZE[quantize]} copy "
            f"({8 * draft_bytes / count:.1f} bits) "
            "would cost about as much per token as the target itself, so it cannot pay. Load the target with "
            "--weights bfloat16 to draft with its quantized copy, or use the early-exit draft (no --draft-model)")
    floats = {k: w.dequantize(torch.float32) if isinstance(w, QuantWeight) else w for k, w in weights.items()}
    draft_weights = quantize_linears(floats, quantize)
    for head in ("embed", "lm_head"):
        w = floats.get(head)
        if w is not None and w.shape[1] % 32 == 0:
            blocks = torch.as_tensor(quantize_blocks(w.float().contiguous(), _HEAD_QTYPE)).reshape(w.shape[0], -1)
            draft_weights[head] = QuantWeight(blocks.contiguous(), _HEAD_QTYPE, tuple(w.shape))
    return LlamaModel(target.config, draft_weights, dtype=target.dtype, device=target.device,
                      weights_mode=f"--draft-model {name}")


def draft_label(config: DraftModelConfig, draft_model_path: str | None = None) -> str:
    """What the draft is, for messages: "early exit (7 of 30 layers)", "self-int4", a path."""
    if config.draft_model is None:
        return f"early exit ({config.early_exit_depth()} of {config.target_model.num_layers} layers)"
    return draft_model_path or "a draft model"


@register_proposer("draft")
def make_draft_proposer(config: DraftModelConfig | None) -> DraftModelProposer:
    """Registry factory; the draft model (or the target, for early exit) comes in the config."""
    if config is None:
        raise ValueError("the draft proposer needs a DraftModelConfig (draft_model or target_model)")
    return DraftModelProposer(config)
