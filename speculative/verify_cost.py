"""What a T-token verify forward costs relative to a 1-token step, measured on the model itself.

Speculation pays only if verifying k draft tokens costs much less than k decode steps, and how
much less depends on the CPU tier, the kernels and the model: so the adaptive planner sizes
drafts with a table measured here, at a short and a long context (a draft's attention cost
grows with the context it attends over). One T-token forward is timed the way the engine runs
it: T = 1 as plain decoding (causal, one logits row), T > 1 as a chain draft is verified (a
per-query tree mask, logits for every row), all through the engine's own `build_forward_batch`.

    samples = measure_forward_seconds(model, block_size, sizes, context)   # blocking (benchmarks)
    tables  = cost_tables(samples_short, samples_long, long_context)       # ratios, monotone
    cal     = Calibration(...); cal.step()                                  # one forward at a time
    drift   = DriftMonitor(tables); drift.observe(seconds, tokens, ctx)     # is the table stale?
    cost    = CostModel(table)(num_tokens)                                  # a table between its points

`CostModel` is the one reading of a table between and past its measured sizes, for every user
(the adaptive planner, the draft gate, the drift check), so a forward costs the same to each.

The tables also keep the 1-token forward's seconds at each context. A CPU's speed changes under
a server (other load, frequency, a neighbour's memory traffic), so `DriftMonitor` compares the
forwards the engine times at batch 1 with what the tables predict; once they disagree by more
than its tolerance, the speculator measures the tables again in idle moments.

Measuring takes seconds to tens of seconds on 2 cores, so the result is cached per (model,
dtype, CPU, kernel build) under the user's cache directory, and a server measures only in idle
moments (`Calibration.step` runs one forward and returns, so a request that arrives meanwhile
waits at most one forward), never before its first request.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Mapping

import numpy as np
import torch

from prescient.cache_dir import cache_dir

log = logging.getLogger("prescient.speculative")

SIZES = (1, 2, 4, 8, 16, 32)
# Contexts the cost is measured at: a chat turn and an agent's long tool output / document.
SHORT_CONTEXT, LONG_CONTEXT = 256, 1024


class CostModel:
    """A cost table (forward tokens -> cost relative to a 1-token step) at any token count:
    piecewise linear through its points and, past either end, along the nearest segment (flat
    for a one-point table), floored at 1e-9.

    The one rule for every reader of a table (adaptive.py's plan, draft_gate.py's verdict,
    CostTables.expected_seconds): past the largest measured size a forward keeps costing what
    each token added there (a flat extension would price a batch's many drafts, or a longer
    chain of draft forwards, at nothing); measured tables start at one token."""

    def __init__(self, table: Mapping[int, float]) -> None:
        points = sorted((int(k), float(v)) for k, v in table.items())
        if not points or points[0][0] < 1 or any(v <= 0 for _, v in points):
            raise ValueError(f"verify_cost needs token counts >= 1 with positive costs, got {dict(table)}")
        if len(points) == 1:
            points.append((points[0][0] + 1, points[0][1]))
        self._num_tokens = np.array([k for k, _ in points], dtype=np.float64)
        self._costs = np.array([v for _, v in points], dtype=np.float64)
        self._xs, self._ys = [float(k) for k, _ in points], [v for _, v in points]

    def __call__(self, num_tokens: float) -> float:
        """many() for one count, in plain floats: the same operations (so the same bits) at a
        tenth of numpy's per-call cost -- the planner asks once or twice per step."""
        xs, ys = self._xs, self._ys
        right = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), 1e-9)

    def many(self, num_tokens: np.ndarray) -> np.ndarray:  # [n] -> [n] float64
        xs, ys = self._num_tokens, self._costs
        # right end of the segment holding each count; the first / last segment outside the table
        right = np.clip(np.searchsorted(xs, num_tokens), 1, len(xs) - 1)
        x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
        return np.maximum(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), 1e-9)


@dataclass(frozen=True)
class CostTables:
    """Forward tokens -> cost relative to a 1-token forward, at `short_context` cached tokens and
    (when the model's positions allow) at `long_context`."""

    short: dict[int, float]
    short_context: int = SHORT_CONTEXT
    long_context: int | None = None
    long: dict[int, float] | None = None
    # seconds of the 1-token forward at short_context / long_context (None: not measured)
    short_base_s: float | None = None
    long_base_s: float | None = None

    def expected_seconds(self, num_tokens: int, context: int) -> float | None:
        """What a batch-1 forward of num_tokens after `context` cached tokens should take by
        these tables (linear between the two contexts, clamped); None without base times."""
        if self.short_base_s is None:
            return None
        short = self.short_base_s * self._short_model(num_tokens)
        if self.long is None or self.long_base_s is None or self.long_context is None:
            return short
        w = min(1.0, max(0.0, (context - self.short_context) / (self.long_context - self.short_context)))
        return short + w * (self.long_base_s * self._long_model(num_tokens) - short)

    # the tables' models, built once (the drift monitor asks every step)
    @cached_property
    def _short_model(self) -> CostModel:
        return CostModel(self.short)

    @cached_property
    def _long_model(self) -> CostModel:
        return CostModel(self.long)

    def install(self, adaptive) -> None:
        """Hand the tables to an AdaptiveSpeculation."""
        long = (self.short_context, self.long_context, self.long) if self.long else None
        adaptive.set_verify_cost(self.short, long)

    def to_json(self) -> dict:
        return {"short": self.short, "short_context": self.short_context, "long_context": self.long_context,
                "long": self.long, "short_base_s": self.short_base_s, "long_base_s": self.long_base_s}

    @classmethod
    def from_json(cls, d: dict) -> "CostTables":
        as_table = lambda t: None if t is None else {int(k): float(v) for k, v in t.items()}  # noqa: E731
        as_float = lambda v: None if v is None else float(v)  # noqa: E731
        return cls(as_table(d["short"]), int(d["short_context"]), d.get("long_context"), as_table(d.get("long")),
                   as_float(d.get("short_base_s")), as_float(d.get("long_base_s")))


class DriftMonitor:
    """Whether measured batch-1 forwards still take what the tables say: an EMA of
    log(measured / expected) over forwards within the tables' sizes. Without base times in the
    tables (an older cache file), the first `min_samples` forwards set the reference."""

    def __init__(self, tables: CostTables, tolerance: float = 0.3, min_samples: int = 32, decay: float = 0.95):
        if not tolerance > 0 or min_samples < 1 or not 0 < decay < 1:
            raise ValueError("DriftMonitor needs tolerance > 0, min_samples >= 1 and decay in (0, 1)")
        self.tables = tables
        self.tolerance, self.min_samples, self.decay = tolerance, min_samples, decay
        self.num_samples = 0
        self.log_ratio = 0.0  # EMA of log(measured / expected)
        self._reference: list[float] = []  # log ratios against a base of 1 s, until the tables have none
        self._offset = 0.0 if tables.short_base_s is not None else None

    def observe(self, seconds: float, num_tokens: int, context: int) -> None:
        # only shapes the tables measured: past their contexts attention alone would read as drift
        measured_context = self.tables.long_context or self.tables.short_context
        if not seconds > 0 or num_tokens > max(self.tables.short) or context > 1.25 * measured_context:
            return
        tables = self.tables if self.tables.short_base_s is not None else CostTables(
            self.tables.short, self.tables.short_context, self.tables.long_context, self.tables.long, 1.0, 1.0)
        value = math.log(seconds / tables.expected_seconds(num_tokens, context))
        if self._offset is None:  # no measured base: the first forwards are the reference
            self._reference.append(value)
            if len(self._reference) < self.min_samples:
                return
            self._offset = sorted(self._reference)[len(self._reference) // 2]
            return
        value -= self._offset
        self.num_samples += 1
        weight = min(self.decay, 1.0 - 1.0 / self.num_samples)  # a plain mean while samples are few
        self.log_ratio = weight * self.log_ratio + (1 - weight) * value

    @property
    def drifted(self) -> bool:
        return self.num_samples >= self.min_samples and abs(self.log_ratio) > math.log1p(self.tolerance)


def _batches(model, block_size: int, sizes, context: int):
    """A scratch KV cache and one ForwardBatch per size, built as the engine builds them."""
    from prescient.runtime.batch import build_forward_batch
    from prescient.runtime.request import Request
    from prescient.runtime.sampling_params import SamplingParams
    from prescient.runtime.scheduler import ScheduledSeq
    from prescient.speculative.tree import DraftTree

    num_blocks = -(-(context + max(sizes)) // block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    batches = {}
    for t in sizes:
        # a scratch request no scheduler holds: its blocks and computed count given at birth
        request = Request("calibrate", [1] * (context + 1), SamplingParams(), (), 0.0,
                          block_ids=list(range(num_blocks)), num_computed_tokens=context)
        tree = DraftTree.chain(1, [1] * (t - 1)) if t > 1 else None
        batches[t] = build_forward_batch([ScheduledSeq(request, t if tree else 1, 0)], [tree], block_size,
                                         model.device)
    return kv, batches


def timed_forwards(model, block_size: int, sizes=SIZES, context: int = SHORT_CONTEXT,
                   repeats: int = 5) -> Iterator[dict[int, list[float]]]:
    """Yields after every forward; the last value yielded is {size: [seconds per repeat]}.
    All sizes are swept once per round, so a burst of load from elsewhere hits every size alike
    instead of inflating one (which could switch drafting off)."""
    sizes = tuple(sorted(set(sizes) | {1}))  # every ratio is against the 1-token step
    kv, batches = _batches(model, block_size, sizes, context)
    samples: dict[int, list[float]] = {t: [] for t in sizes}
    # no inference_mode around the yields (LlamaModel.forward enters it itself): a half-done
    # idle calibration must not leave the engine thread inside the guard between steps
    for t in sizes:  # warm-up: first calls pay for allocations and dispatch
        model.forward(batches[t], kv)
        yield samples
    for _ in range(repeats):
        for t in sizes:
            t0 = time.perf_counter()
            model.forward(batches[t], kv)
            if model.device.type == "cuda":  # time the kernels, not their launch
                torch.cuda.synchronize(model.device)
            samples[t].append(time.perf_counter() - t0)
            yield samples


def measure_forward_seconds(model, block_size: int, sizes=SIZES, context: int = SHORT_CONTEXT,
                            repeats: int = 5) -> dict[int, list[float]]:
    """{size: [seconds per repeat]} of a forward of `size` new tokens after `context` cached ones."""
    samples: dict[int, list[float]] = {}
    for samples in timed_forwards(model, block_size, sizes, context, repeats):
        pass
    return samples


def ratio_table(samples: dict[int, list[float]]) -> dict[int, float]:
    """Best-of-repeats time of each size over the 1-token one, made non-decreasing (timing noise
    must not make 8 tokens look cheaper than 4) and at most t (t tokens in one forward never
    cost more than t one-token forwards: a measured 2.35 for 2 tokens, seen on a busy 2-core
    machine, would switch speculation off for as long as the cached table lives)."""
    base = min(samples[1])
    table, running = {}, 1.0
    for t in sorted(samples):
        running = max(running, min(min(samples[t]) / base, float(t)))
        table[t] = running
    return table


def long_context_for(model) -> int | None:
    """The long context, if the model's positions fit it with room for the largest verify."""
    long_ctx = min(LONG_CONTEXT, model.config.max_position_embeddings - 64)
    return long_ctx if long_ctx > SHORT_CONTEXT else None


class Calibration:
    """The cost tables of one (target, draft) pair, measured one forward per `step()`.

    With a draft model, each draft token also costs about one draft forward (chain drafting),
    measured relative to a target step and added to the tables."""

    def __init__(self, model, block_size: int, draft=None, repeats: int = 5):
        self.model, self.draft = model, draft
        self.block_size, self.repeats = block_size, repeats
        self.long_context = long_context_for(model)
        self.tables: CostTables | None = None
        self._phases = self._run()

    def step(self) -> bool:
        """Run one forward; True once the tables are ready (then it does nothing)."""
        if self.tables is None:
            try:
                next(self._phases)
            except StopIteration:
                pass
        return self.tables is not None

    def _run(self) -> Iterator[None]:
        short = long = None
        for short in timed_forwards(self.model, self.block_size, SIZES, SHORT_CONTEXT, self.repeats):
            yield
        if self.long_context is not None:
            for long in timed_forwards(self.model, self.block_size, SIZES, self.long_context, self.repeats):
                yield
        short_table = ratio_table(short)
        long_table = ratio_table(long) if long else None
        if self.draft is not None:
            draft = {}
            for draft in timed_forwards(self.draft, self.block_size, (1,), SHORT_CONTEXT, 3):
                yield
            draft_ratio = min(draft[1]) / min(short[1])
            short_table = {t: c + (t - 1) * draft_ratio for t, c in short_table.items()}
            long_table = long_table and {t: c + (t - 1) * draft_ratio for t, c in long_table.items()}
        self.tables = CostTables(short_table, SHORT_CONTEXT, self.long_context if long_table else None, long_table,
                                 min(short[1]), min(long[1]) if long_table else None)


# ---------------------------------------------------------------- the on-disk cache


def cache_key(model_identity: str, method: str, block_size: int, device: str = "cpu") -> str:
    """What a cost table depends on: the model (its weights' content and dtype, set by the
    builder), the proposer kind, the KV block size and what runs it: on CPU the CPU and the C
    kernels' build, on CUDA the device and torch."""
    if device == "cpu":
        from prescient.kernels.cpu_linear import build_signature
        from prescient.kernels.quant_linear import default_layout

        # the block formats' kernels also depend on the weight copies' layout (PRESCIENT_REGROUP_*)
        budget = os.environ.get("PRESCIENT_REGROUP_MB", "").strip()
        runs_on = f"{build_signature()}|copies {default_layout()} {budget or 'default'}"
    else:
        runs_on = f"{torch.cuda.get_device_name(torch.device(device))}|{torch.__version__}|{torch.version.cuda}"
    return "|".join((model_identity, method, str(block_size), runs_on))


def _cache_file(key: str):
    return cache_dir("verify_cost") / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load_cached(key: str) -> CostTables | None:
    path = _cache_file(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return CostTables.from_json(data["tables"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# The kernel library's file in a CPU key (kernels/cpu_linear: named by its sources' hash).
_KERNEL_BUILD = re.compile(r"cpu_gemv-[0-9a-f]+\.so")


def load_sibling(key: str) -> CostTables | None:
    """The newest cached table whose key differs from `key` in the kernel library's build alone
    (the same model, proposer, block size, CPU, tier, threads and weight copies): the prior a
    server plans with while it measures its own build's table (an upgrade changes the build, and
    the costs of most of its kernels with it little). None for a key without a kernel build."""
    if not _KERNEL_BUILD.search(key):
        return None
    want = _KERNEL_BUILD.sub("\0", key)
    best: tuple[float, dict] | None = None
    try:
        paths = list(cache_dir("verify_cost").glob("*.json"))
    except OSError:
        return None
    for path in paths:
        try:
            data = json.loads(path.read_text())
            other = data["key"]
            if other == key or _KERNEL_BUILD.sub("\0", other) != want:
                continue
            when = float(data.get("measured_at", 0.0))
            if best is None or when > best[0]:
                best = (when, data["tables"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        return None if best is None else CostTables.from_json(best[1])
    except (ValueError, KeyError, TypeError):
        return None


def save_cached(key: str, tables: CostTables) -> None:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "tables": tables.to_json(), "measured_at": time.time()}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the next start measures again
        log.warning("could not cache the verify-cost table (%s)", e)
