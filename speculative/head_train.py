"""Training an EAGLE draft head for a target (the command: prescient/train_head.py).

The head (speculative/eagle_head.py) learns to predict the target's next feature from its
current one, so it is trained on the target's own behaviour: the bundled chat prompts
(speculative/data/head_prompts.jsonl) are run through the target (one greedy and some sampled
outputs each), every sequence then goes through one plain forward that keeps the features, and
the head is fitted to them. The result is a head file (the draft vocab's ids, fc and the
layer), by default where the runtime looks for the target's head (eagle_head.default_head_path).

    prompts -> generate_outputs -> collect_features -> draft_vocab -> init_head -> train_head -> save

Each phase is a function a test drives on a tiny model; `main` strings them together.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from prescient.speculative.eagle_head import EagleHead, HeadConfig

PROMPTS = Path(__file__).resolve().parent / "data" / "head_prompts.jsonl"
DATA_FORMAT = "prescient-head-data/1"
CE_WEIGHT = 0.1  # EAGLE's weight of the token loss beside the feature regression


def _log(message: str) -> None:
    print(f"head_train: {message}", file=sys.stderr, flush=True)


class _Progress:
    """A line on stderr each time another ~10% of `total` items is done."""

    def __init__(self, what: str, total: int, enabled: bool = True):
        self.what, self.total, self.enabled = what, max(1, total), enabled
        self.t0, self.next_tenth = time.perf_counter(), 1

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled or done * 10 < self.next_tenth * self.total:
            return
        while done * 10 >= self.next_tenth * self.total:
            self.next_tenth += 1
        dt = time.perf_counter() - self.t0
        _log(f"{self.what}: {done}/{self.total}, {tokens} tokens, {tokens / max(dt, 1e-9):.0f} tok/s, {dt:.0f} s")


# ---------------------------------------------------------------- prompts

def load_prompts(path: str | Path = PROMPTS, limit: int | None = None) -> list[list[dict]]:
    """The prompt set: one chat (a list of messages) per JSONL line, the first `limit` of them."""
    chats = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            chats.append(json.loads(line)["messages"])
    return chats[:limit] if limit is not None else chats


def render_prompts(tokenizer, chats: list[list[dict]]) -> list[list[int]]:
    """Each chat as the server renders it (the chat template, with the generation prompt)."""
    return [tokenizer.apply_chat_template(messages) for messages in chats]


# ---------------------------------------------------------------- the target's outputs

@dataclass
class Sample:
    prompt_index: int
    kind: str  # "greedy" | "sampled"
    prompt_ids: list[int]
    output_ids: list[int]  # the stop token included, when the output ended on one


def generate_outputs(engine, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.7,
                     seed: int = 0, progress: bool = True, samples: int = 1) -> list[Sample]:
    """Per prompt the target's greedy output and `samples` sampled at `temperature` (seeds
    derived from `seed` and the prompt's index, so a rerun draws the same), batched through the
    engine. -> Samples in prompt order, greedy first; a request that fails is left out with a
    warning."""
    from prescient.runtime.sampling_params import SamplingParams

    jobs = deque()
    for i, ids in enumerate(prompts):
        jobs.append((i, "greedy", ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0)))
        for j in range(samples):  # sample j of prompt i: seed + i + j * len(prompts), all distinct
            jobs.append((i, "sampled", ids, SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                           seed=seed + i + j * len(prompts))))
    total = len(jobs)
    # at most a batch in flight: a queue deeper than the batch would wait, and the engine fails
    # requests that wait past max_queue_wait_s
    limit = engine.config.scheduler.max_num_seqs
    live: dict[str, Sample] = {}
    done: list[Sample] = []
    tokens, finished = 0, 0
    bar = _Progress("generating", total, progress)
    while jobs or live:
        while jobs and len(live) < limit:
            i, kind, ids, params = jobs.popleft()
            live[engine.add_request(list(ids), params).request_id] = Sample(i, kind, list(ids), [])
        for out in engine.step():
            sample = live.get(out.request_id)
            if sample is None:
                continue
            sample.output_ids.extend(out.new_token_ids)
            tokens += len(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                finished += 1
                if out.error:
                    _log(f"warning: prompt {sample.prompt_index} ({sample.kind}) failed: {out.error}")
                elif sample.output_ids:
                    done.append(sample)
                bar.update(finished, tokens)
    done.sort(key=lambda s: (s.prompt_index, s.kind != "greedy"))
    return done


# ---------------------------------------------------------------- features

@dataclass
class Seq:
    """One training sequence: the target's features at every position and its argmax there."""

    tokens: torch.Tensor  # int64 [T]: prompt + output
    prompt_len: int
    features: torch.Tensor  # [T, hidden] (bf16 kept; fp32 when computed): f_t after the final norm
    argmax: torch.Tensor  # int64 [T]: the target's argmax over its full LM head at position t
    prompt_index: int = 0
    kind: str = "greedy"


def sequence_features(model, token_lists: list[Sequence[int]], chunk: int = 1024,
                      block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain prefill forwards over whole sequences with `keep_hidden` set: their rows packed
    into forwards of at most `chunk` rows (several short sequences in one, a long one over
    several), each sequence its own blocks of a scratch KV cache sized to them all (the caller
    keeps the list short). -> per sequence (features [T, hidden] fp32, argmax [T] int64)."""
    from prescient.runtime.batch import SeqRows, pack_forward_batch

    tables, first = [], 0
    for ids in token_lists:
        n = -(-len(ids) // block_size)
        tables.append(list(range(first, first + n)))
        first += n
    kv = model.allocate_kv_cache(first, block_size)
    # the forwards, each a list of (sequence, start, stop): a sequence's pieces run in order
    plan, cur, room = [], [], chunk
    for k, ids in enumerate(token_lists):
        start = 0
        while start < len(ids):
            stop = start + min(room, len(ids) - start)
            cur.append((k, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                plan.append(cur)
                cur, room = [], chunk
    if cur:
        plan.append(cur)
    feats = [[] for _ in token_lists]
    argmax = [[] for _ in token_lists]
    kept = model.keep_hidden
    model.keep_hidden = True
    try:
        for pieces in plan:
            rows = [SeqRows(token_lists[k][a:b], range(a, b), a, tables[k], None, range(b - a)) for k, a, b in pieces]
            # logits of every row: the target's own argmax at each position (the acc@1 reference)
            logits = model.forward(pack_forward_batch(rows, block_size, model.device), kv)
            f = model.features(model.last_hidden).cpu()
            best = logits.argmax(-1).cpu()
            row = 0
            for k, a, b in pieces:
                feats[k].append(f[row:row + b - a])
                argmax[k].append(best[row:row + b - a])
                row += b - a
    finally:
        model.keep_hidden, model.last_hidden = kept, None
    return [(torch.cat(f), torch.cat(m).to(torch.int64)) for f, m in zip(feats, argmax)]


def _groups(samples: list[Sample], tokens: int) -> Iterable[list[Sample]]:
    """Consecutive samples, about `tokens` tokens a group (a longer sample alone)."""
    group, size = [], 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.output_ids)
        if group and size + n > tokens:
            yield group
            group, size = [], 0
        group.append(s)
        size += n
    if group:
        yield group


def collect_features(model, samples: list[Sample], dtype: torch.dtype = torch.bfloat16, chunk: int = 1024,
                     progress: bool = True) -> list[Seq]:
    """Every sample's features, kept in `dtype` (bf16: half the memory; the loss widens them).
    Samples go through in groups of about `chunk` tokens: one forward for many samples (each
    forward reads every weight; its linears run the decode kernels 64 rows a call, as serving
    does, so the features are the ones the head sees when it drafts)."""
    seqs, tokens = [], 0
    bar = _Progress("features", len(samples), progress)
    for group in _groups(samples, chunk):
        lists = [s.prompt_ids + s.output_ids for s in group]
        for s, ids, (feats, argmax) in zip(group, lists, sequence_features(model, lists, chunk)):
            seqs.append(Seq(torch.tensor(ids, dtype=torch.int64), len(s.prompt_ids), feats.to(dtype), argmax,
                            s.prompt_index, s.kind))
            tokens += len(ids)
        bar.update(len(seqs), tokens)
    return seqs


def save_data(path: str | Path, seqs: list[Seq], fingerprint: str, meta: dict | None = None) -> None:
    """The generated tokens and their features, so training can rerun without the target's work."""
    torch.save({"format": DATA_FORMAT, "fingerprint": fingerprint, "meta": json.dumps(meta or {}),
                "tokens": [s.tokens for s in seqs], "prompt_lens": [s.prompt_len for s in seqs],
                "features": [s.features for s in seqs], "argmax": [s.argmax for s in seqs],
                "prompt_index": [s.prompt_index for s in seqs], "kind": [s.kind for s in seqs]}, str(path))


def load_data(path: str | Path, fingerprint: str | None = None) -> tuple[list[Seq], dict]:
    """-> (sequences, meta); ValueError for another file, or one made for another target."""
    d = torch.load(str(path), weights_only=True)
    if not isinstance(d, dict) or d.get("format") != DATA_FORMAT:
        raise ValueError(f"{path} is not a head training data file")
    if fingerprint is not None and d["fingerprint"] != fingerprint:
        raise ValueError(f"{path} was made with target {d['fingerprint']}, this target is {fingerprint}")
    seqs = [Seq(*fields) for fields in zip(d["tokens"], d["prompt_lens"], d["features"], d["argmax"],
                                           d["prompt_index"], d["kind"])]
    return seqs, json.loads(d["meta"])


# ---------------------------------------------------------------- the draft vocab and the LM head rows

def draft_vocab(outputs: Iterable[Sequence[int]], size: int, vocab_size: int,
                eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """The `size` (at most vocab_size) most frequent token ids of the outputs, ties to the lower
    id, the stop tokens always in (a head that cannot draft the end makes every output one
    token longer to verify). -> int64 ids, ascending."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for out in outputs:
        if len(out):
            counts += torch.bincount(torch.as_tensor(list(out), dtype=torch.int64), minlength=vocab_size)
    size = min(size, vocab_size)
    eos = torch.tensor(list(dict.fromkeys(e for e in eos_ids if 0 <= e < vocab_size)), dtype=torch.int64)
    order = torch.sort(-counts, stable=True).indices  # by count, then by id
    ranked = torch.cat([eos, order[~torch.isin(order, eos)]])
    return ranked[:size].sort().values


def dense_weight(lin) -> torch.Tensor:
    """A runtime linear's weight as fp32 [out, in], whatever it is held as."""
    from prescient.runtime.linear import ColumnGroups, ConcatLinear, Linear, QuantizedLinear

    if isinstance(lin, torch.Tensor):
        return lin.float()
    if isinstance(lin, QuantizedLinear):
        return lin.qweight.dequantize(torch.float32)
    if isinstance(lin, ConcatLinear):  # parts side by side in the output: rows
        return torch.cat([dense_weight(p) for p in lin.parts], dim=0)
    if isinstance(lin, ColumnGroups):  # groups of input columns, in order
        return torch.cat([dense_weight(p) for p in lin.parts], dim=1)
    if isinstance(lin, Linear):
        return lin.weight.float()
    raise TypeError(f"cannot read the weight of a {type(lin).__name__}")


def embedder(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids [n] -> the target's embeddings [n, hidden] fp32 (the head's token input)."""
    def embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.embed_tokens(ids.to(model.device)).float().cpu()
    return embed


# ---------------------------------------------------------------- the head

def init_head(model, draft_ids: torch.Tensor, fingerprint: str, seed: int = 0) -> EagleHead:
    """A head whose layer starts as the target's last decoder layer (attention and MLP weights
    that already read this model's hidden states; fit_branch_scale then sizes their updates)
    and whose fc passes f_t through (x_t = f_t, plus a small embedding term, at the start)."""
    cfg = model.config
    head = EagleHead(HeadConfig.for_target(cfg, fingerprint, len(draft_ids)), cfg, draft_ids)
    last = model.layers[-1]
    q_size, kv_size, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    # the head's layer has no input norm (EAGLE: its input is fc's output); the target layer's
    # norm weight scaled the columns q/k/v read, so it is folded into them. A Qwen2 q/k/v bias
    # has no place in the head and is dropped (training absorbs it).
    qkv = dense_weight(last.qkv) * last.attn_norm.float()[None, :]
    q, k, v = qkv.split([q_size, kv_size, kv_size])
    gate, up = dense_weight(last.gate_up).split([inter, inter])
    gen = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    fc = torch.cat([torch.randn(h, h, generator=gen) * 0.02, torch.eye(h)], dim=1)  # [embed | feature]
    with torch.no_grad():
        for param, value in ((head.fc.weight, fc), (head.q.weight, q), (head.k.weight, k), (head.v.weight, v),
                             (head.o.weight, dense_weight(last.o)), (head.gate.weight, gate),
                             (head.up.weight, up), (head.down.weight, dense_weight(last.down)),
                             (head.mlp_norm, last.mlp_norm.float())):
            param.copy_(value)
    return head


@dataclass
class Batch:
    """Whole sequences padded to the longest. Row t: input (embed(x_{t+1}), f_t), target
    f_{t+1}; `mask` marks the rows that are trained and scored."""

    embeds: torch.Tensor  # [B, R, hidden] fp32
    feats: torch.Tensor  # [B, R, hidden] fp32: f_t
    next_feats: torch.Tensor  # [B, R, hidden] fp32: f_{t+1}
    next_argmax: torch.Tensor  # [B, R] int64: the target's argmax at t + 1
    mask: torch.Tensor  # [B, R] bool
    positions: torch.Tensor  # [R]


def make_batch(seqs: list[Seq], embed: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """Rows t = 0 .. T-2 of each sequence; the mask keeps the rows a decode drafts from (t >=
    prompt_len - 1: the first draft follows the prefill's last position), as EAGLE masks its
    loss to the responses. The prompt rows still feed the attention."""
    rows = max(len(s.tokens) - 1 for s in seqs)
    h = seqs[0].features.shape[1]
    b = len(seqs)
    embeds, feats, nxt = (torch.zeros(b, rows, h) for _ in range(3))
    argmax = torch.zeros(b, rows, dtype=torch.int64)
    mask = torch.zeros(b, rows, dtype=torch.bool)
    for i, s in enumerate(seqs):
        r = len(s.tokens) - 1
        embeds[i, :r] = embed(s.tokens[1:])
        feats[i, :r] = s.features[:-1].float()
        nxt[i, :r] = s.features[1:].float()
        argmax[i, :r] = s.argmax[1:]
        mask[i, max(0, s.prompt_len - 1):r] = True
    return Batch(embeds, feats, nxt, argmax, mask, torch.arange(rows))


def batches_of(seqs: list[Seq], batch_tokens: int) -> list[list[Seq]]:
    """Sequences grouped by length (little padding), each group at most `batch_tokens` padded
    rows (and at least one sequence)."""
    order = sorted(seqs, key=lambda s: len(s.tokens))
    groups, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s.tokens) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    return groups


def feature_scale(seqs: list[Seq]) -> torch.Tensor:
    """Each feature dimension's standard deviation over the sequences, fp32 [hidden]."""
    total = sum(len(s.tokens) for s in seqs)
    mean = sum(s.features.float().sum(0) for s in seqs) / total
    var = sum(((s.features.float() - mean) ** 2).sum(0) for s in seqs) / total
    return var.sqrt()


def token_feature_loss(pred: torch.Tensor, target: torch.Tensor, w_d: torch.Tensor) -> torch.Tensor:
    """pred, target [N, hidden] -> SmoothL1(pred, target) + CE_WEIGHT * the soft cross-entropy
    of the head's draft-vocab distribution against the target's (both through w_d)."""
    with torch.no_grad():
        p_target = (target @ w_d.T).softmax(-1)
    ce = -(p_target * (pred @ w_d.T).log_softmax(-1)).sum(-1).mean()
    return F.smooth_l1_loss(pred, target) + CE_WEIGHT * ce


def head_loss(head: EagleHead, w_d: torch.Tensor, batch: Batch, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of a batch over its masked rows. noise: [hidden], the amplitude of the
    uniform noise added to the input features (None: none)."""
    feats = batch.feats
    if noise is not None:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * noise
    pred = head.forward_train(batch.embeds, feats, batch.positions)
    return token_feature_loss(pred[batch.mask], batch.next_feats[batch.mask], w_d)


@torch.no_grad()
def evaluate(head: EagleHead, w_d: torch.Tensor, seqs: list[Seq], embed, batch_tokens: int = 4096) -> dict:
    """On the masked rows, without noise: the loss, acc@1 (the head's argmax over the draft
    vocab, as a target id, equals the target's argmax over its full vocab: the depth-1
    acceptance proxy) and in_vocab (the target's argmax is in the draft vocab: acc@1's bound)."""
    was = head.training
    head.eval()
    loss_sum, hits, inside, n = 0.0, 0, 0, 0
    for group in batches_of(seqs, batch_tokens):
        batch = make_batch(group, embed)
        rows = int(batch.mask.sum())
        if not rows:
            continue
        pred = head.forward_train(batch.embeds, batch.feats, batch.positions)[batch.mask]
        loss_sum += token_feature_loss(pred, batch.next_feats[batch.mask], w_d).item() * rows
        drafted = head.draft_ids[(pred @ w_d.T).argmax(-1)]
        target = batch.next_argmax[batch.mask]
        hits += int((drafted == target).sum())
        inside += int(torch.isin(target, head.draft_ids).sum())
        n += rows
    head.train(was)
    n = max(n, 1)
    return {"loss": loss_sum / n, "acc1": hits / n, "in_vocab": inside / n, "positions": n}


BRANCH_SCALES = (1.0, 0.3, 0.1, 0.03, 0.01, 0.0)


@torch.no_grad()
def fit_branch_scale(head: EagleHead, w_d: torch.Tensor, seqs: list[Seq], embed, sample: int = 16) -> float:
    """Scale the copied layer's two branch outputs (o, down) by the BRANCH_SCALES factor with the
    lowest loss on `sample` sequences spread over `seqs`, and return it. The target's layer adds
    updates sized for its residual stream, which runs far above the features' scale (SmolLM2:
    f^ came out at 11x the features' RMS as copied, the loss 18x the pass-through's); 0 starts
    the head as f^_{t+1} = f_t."""
    picked = seqs[::max(1, len(seqs) // sample)][:sample]
    o, down = head.o.weight.clone(), head.down.weight.clone()
    losses = {}
    for scale in BRANCH_SCALES:
        head.o.weight.copy_(o * scale)
        head.down.weight.copy_(down * scale)
        losses[scale] = evaluate(head, w_d, picked, embed)["loss"]
    best = min(BRANCH_SCALES, key=lambda c: losses[c])
    head.o.weight.copy_(o * best)
    head.down.weight.copy_(down * best)
    return best


def split_holdout(seqs: list[Seq], frac: float = 0.05, seed: int = 0) -> tuple[list[Seq], list[Seq]]:
    """(train, held out): a random `frac` of the prompts (at least one, when there are two or
    more) held out with all their sequences, so no held-out prompt was seen in training."""
    prompts = sorted({s.prompt_index for s in seqs})
    n_held = min(len(prompts) - 1, max(1, round(frac * len(prompts)))) if frac > 0 else 0
    held = set(random.Random(seed).sample(prompts, n_held))
    return [s for s in seqs if s.prompt_index not in held], [s for s in seqs if s.prompt_index in held]


def cosine_lr(step: int, done: float, warmup: int) -> float:
    """The learning-rate factor: linear over the first `warmup` steps, then a cosine decay to
    0 as `done` (the fraction of the run behind, 0..1) reaches 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


@dataclass
class _Run:
    """One training run's optimizer and clock: the schedule follows whichever of the epoch
    count and the time limit ends the run first, so the decay completes either way."""

    opt: torch.optim.Optimizer
    lr: float
    total_steps: int
    warmup: int
    t0: float
    seconds: float
    step: int = 0

    def done(self) -> float:
        return max(self.step / max(1, self.total_steps), (time.perf_counter() - self.t0) / max(self.seconds, 1e-9))

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t0 > self.seconds


def _train_epoch(head: EagleHead, w_d: torch.Tensor, groups: list[list[Seq]], embed, amp, run: _Run) -> list[float]:
    """One pass over the batches (stopping at the time limit). -> the batches' losses."""
    params = [p for p in head.parameters() if p.requires_grad]
    losses = []
    for group in groups:
        if run.out_of_time():
            break
        batch = make_batch(group, embed)
        if not batch.mask.any():
            continue
        for g in run.opt.param_groups:
            g["lr"] = run.lr * cosine_lr(run.step, run.done(), run.warmup)
        loss = head_loss(head, w_d, batch, amp)
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        run.opt.step()
        losses.append(loss.item())
        run.step += 1
    return losses


def _report(record: dict, what: str) -> None:
    line = f"{what}: " + (f"train loss {record['train_loss']:.4f}, " if "train_loss" in record else "")
    if "held_loss" in record:
        line += (f"held-out loss {record['held_loss']:.4f}, acc@1 {record['held_acc1']:.3f} (target argmax in "
                 f"the draft vocab {record['held_in_vocab']:.3f}, {record['held_positions']} positions), ")
    _log(line + f"{record.get('minutes', 0.0):.1f} min")


def train_head(head: EagleHead, w_d: torch.Tensor, train: list[Seq], held: list[Seq], embed, *,
               epochs: int = 8, minutes: float = 40.0, lr: float = 1e-3, batch_tokens: int = 2048,
               noise: float = 0.1, seed: int = 0, progress: bool = True) -> list[dict]:
    """AdamW on whole-sequence batches for `epochs` or `minutes`, whichever comes first; after
    each epoch the train loss and the held-out evaluation. -> one dict per epoch (the last one
    possibly cut short by the time limit)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    # EAGLE's noise is U(-0.1, 0.1) in absolute units, on features of O(1) entries. Here it is
    # relative to each dimension's own spread: a final norm's weights set the features' scale
    # per dimension (SmolLM2's standard deviations run from 0.8 to 13), and the point is to make
    # the head tolerate errors like its own predictions' at deeper draft steps, which scale too.
    amp = noise * feature_scale(train) if noise > 0 else None
    groups = batches_of(train, batch_tokens)
    total = epochs * len(groups)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    if held and progress:
        _report({f"held_{k}": v for k, v in evaluate(head, w_d, held, embed).items()}, "before training")
    run = _Run(opt, lr, total, max(1, min(100, total // 30)), time.perf_counter(), minutes * 60)
    head.train()
    history = []
    for epoch in range(1, epochs + 1):
        rng.shuffle(groups)
        losses = _train_epoch(head, w_d, groups, embed, amp, run)
        record = {"epoch": epoch, "steps": run.step, "train_loss": sum(losses) / max(1, len(losses)),
                  "minutes": (time.perf_counter() - run.t0) / 60}
        if held:
            record.update({f"held_{k}": v for k, v in evaluate(head, w_d, held, embed).items()})
        history.append(record)
        if progress:
            _report(record, f"epoch {epoch}")
        if run.out_of_time():
            if progress:
                _log(f"the {minutes:g}-minute limit is reached: stopping after epoch {epoch}")
            break
    head.eval()
    return history


# ---------------------------------------------------------------- the command
