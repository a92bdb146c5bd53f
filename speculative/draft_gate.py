"""Whether a draft model can pay, decided at start: `--speculate draft` refuses a draft that cannot.

The rule. A chain of k draft tokens, each accepted with probability `a` given its parents were
(the i.i.d. model adaptive.py plans with), yields E(k) = 1 + a + ... + a^k tokens per step. The
speculator's cost table T (verify_cost.Calibration with the draft: T(t) = the target's t-token
verify forward plus the t - 1 draft forwards that chained the draft, both relative to one plain
target step, at the short context; between and past its sizes as verify_cost.CostModel reads
every table) makes that step cost T(k + 1) plain steps. So

    speedup(k) = E(k) / T(k + 1),    best = max over k in 1..max_depth of speedup(k)

(max_depth: the proposer's longest chain) and the draft is refused when best <= 1: no draft
length makes it faster than plain decoding. `a` is measured, not assumed: the target decodes a
few short chat prompts greedily and the draft, fed the same tokens (teacher forcing, one causal
forward), is scored on how often its argmax is the target's next token. Acceptance and table are
cached together (per target, draft, KV block size and machine: the cost table's key) under the
user's cache directory, so a later start decides in milliseconds. `force=True` (`--force-draft`) starts it anyway.

The estimate leaves out per-step costs outside the forwards (the engine's, the draft's
bookkeeping), so it errs towards starting: a refusal is safe, a start is no promise (the
adaptive planner still shortens or stops drafting that does not pay).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass

import torch

from prescient.cache_dir import cache_dir
from prescient.runtime.batch import SeqRows, pack_forward_batch
from prescient.speculative.verify_cost import CostModel, load_cached

log = logging.getLogger("prescient.speculative")

# Short chat turns: what the draft is asked to continue in interactive use.
CALIBRATION_CHATS = (
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing a clear email to a colleague.",
    "What is the difference between a list and a tuple in Python?",
)
NEW_TOKENS = 40  # target tokens decoded per calibration chat


class DraftCannotPay(ValueError):
    """`--speculate draft` with a draft whose measured figures give no speedup."""


@dataclass(frozen=True)
class DraftVerdict:
    acceptance: float  # P(draft argmax == target's next token), teacher-forced
    num_scored: int  # positions it was measured over
    table: dict[int, float]  # forward tokens -> cost in plain steps, draft forwards included
    best_k: int  # draft length with the highest expected speedup
    best_speedup: float

    @property
    def pays(self) -> bool:
        return self.best_speedup > 1.0

    def describe(self) -> str:
        costs = ", ".join(f"{t}: {c:.2f}" for t, c in sorted(self.table.items()) if t <= 9)
        return (f"draft acceptance {self.acceptance:.2f} (over {self.num_scored} target tokens), step cost in plain "
                f"steps {{{costs}}} (target verify + draft forwards): best expected speedup "
                f"{self.best_speedup:.2f}x at {self.best_k} draft token{'s' * (self.best_k > 1)}")


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens per step with k chained draft tokens."""
    return sum(acceptance ** j for j in range(k + 1))


def judge(acceptance: float, num_scored: int, table: dict[int, float], max_draft_tokens: int = 16) -> DraftVerdict:
    """The module docstring's rule over draft lengths 1..max_draft_tokens."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    best_k, best, cost = 1, 0.0, CostModel(table)
    for k in range(1, max_draft_tokens + 1):
        speedup = expected_tokens(acceptance, k) / cost(k + 1)
        if speedup > best:
            best_k, best = k, speedup
    return DraftVerdict(acceptance, num_scored, dict(table), best_k, best)


# ---------------------------------------------------------------- measuring acceptance


def _forward_all(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One causal forward over token_ids from an empty KV. -> logits [len(token_ids), vocab]."""
    num_blocks = -(-len(token_ids) // block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    rows = SeqRows(token_ids, list(range(len(token_ids))), 0, list(range(num_blocks)), None,
                   list(range(len(token_ids))))
    return model.forward(pack_forward_batch([rows], block_size, model.device), kv)


def _greedy(model, prompt: list[int], new_tokens: int, stop: set[int], block_size: int = 16) -> list[int]:
    """The target's greedy continuation of prompt (up to new_tokens, ending at a stop token)."""
    total = len(prompt) + new_tokens
    num_blocks = -(-total // block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    blocks = list(range(num_blocks))
    ids, start, out = list(prompt), 0, []
    while len(out) < new_tokens:
        rows = SeqRows(ids[start:], list(range(start, len(ids))), start, blocks, None, [len(ids) - start - 1])
        logits = model.forward(pack_forward_batch([rows], block_size, model.device), kv)  # [1, vocab]
        token = int(logits[0].argmax())
        start = len(ids)
        ids.append(token)
        out.append(token)
        if token in stop:
            break
    return out


def measure_acceptance(target, draft, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                       stop_ids: tuple[int, ...] = ()) -> tuple[float, int]:
    """(fraction of the target's greedy tokens the draft's argmax predicts, how many were scored)
    over each prompt's greedy continuation, the draft teacher-forced on prompt + continuation."""
    vocab = min(target.config.vocab_size, draft.config.vocab_size)
    hits = scored = 0
    for prompt in prompts:
        continuation = _greedy(target, prompt, new_tokens, set(stop_ids))
        ids = prompt + continuation
        logits = _forward_all(draft, ids)  # [len(ids), vocab]
        predicted = logits[len(prompt) - 1:len(ids) - 1, :vocab].argmax(-1).tolist()
        hits += sum(int(p == t) for p, t in zip(predicted, continuation))
        scored += len(continuation)
    return (hits / scored if scored else 0.0), scored


def calibration_prompts(tokenizer, vocab_size: int) -> list[list[int]]:
    """The calibration chats as prompt ids (a fixed pseudo-random prompt per chat without a
    tokenizer: tiny test models)."""
    if tokenizer is not None:
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in CALIBRATION_CHATS]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (24,), generator=gen).tolist() for _ in CALIBRATION_CHATS]


# ---------------------------------------------------------------- the cache


def _cache_file(key: str):
    return cache_dir("draft_gate") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load_cached_acceptance(key: str) -> tuple[float, int] | None:
    try:
        data = json.loads(_cache_file(key).read_text())
        if data.get("key") != key:
            return None
        return float(data["acceptance"]), int(data["num_scored"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached_acceptance(key: str, acceptance: float, num_scored: int) -> None:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "acceptance": acceptance, "num_scored": num_scored}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the next start measures again
        log.warning("could not cache the draft acceptance (%s)", e)


# ---------------------------------------------------------------- the gate


def check_draft_pays(speculator, target, label: str, tokenizer=None, eos_token_ids: tuple[int, ...] = (),
                     cache_key: str | None = None, force: bool = False, use_cache: bool = True,
                     tables=None) -> DraftVerdict:
    """Measure (or read from the cache) the draft speculator's cost table and acceptance, then
    judge them; raises DraftCannotPay when no draft length pays, unless `force` (then warns).
    A pending table measurement is finished now: the verdict needs it. use_cache=False measures
    the acceptance again (`--calibrate fresh`). `tables` (verify_cost.CostTables) replaces the
    speculator's (tests, and tools that measured their own)."""
    calibration = speculator.calibration
    if tables is not None:
        pass
    elif calibration is not None:
        while speculator.idle_work():
            pass
        tables = calibration.tables
    else:
        tables = load_cached(cache_key) if cache_key is not None else None
    if tables is None:
        raise RuntimeError("the draft gate needs the speculator's measured cost table (calibrate is off?)")
    measured = load_cached_acceptance(cache_key) if cache_key is not None and use_cache else None
    if measured is None:
        draft = speculator.proposer.model
        measured = measure_acceptance(target, draft, calibration_prompts(tokenizer, target.config.vocab_size),
                                      stop_ids=eos_token_ids)
        if cache_key is not None:
            save_cached_acceptance(cache_key, *measured)
    # a chain is as long as the proposer's deepest draft token
    max_k = speculator.proposer.config.max_depth
    verdict = judge(measured[0], measured[1], tables.short, max_k)
    if not verdict.pays:
        message = (f"--speculate draft with {label}: {verdict.describe()}, so it cannot be faster than plain "
                   "decoding on this machine")
        if not force:
            raise DraftCannotPay(message + "; refusing to start. Use --speculate ngram or off, another "
                                 "--draft-model, or --force-draft to run it anyway")
        log.warning("%s; starting anyway (--force-draft)", message)
    return verdict
