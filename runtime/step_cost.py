"""What a step will cost, predicted from what steps have cost: the scheduler's time budget.

A step's wall time (schedule to commit, what every running stream waits between deliveries) is
modelled as two parts, each linear in a few features and refitted online by recursive least
squares (with forgetting, so a machine that gets busier is followed within tens of steps; the
priors stay as a ridge, so a direction the recent steps never moved along keeps its prior):

    decode(rows, ctx)          = d0 * forwards + d1 * rows + d2 * rows * ctx / 1000      every step
    prefill(tokens, ctx, frac) = frac * (p0 * tokens + p1 * tokens * ctx / 1000)

`rows` are the decode/verify rows (a draft tree's nodes) and short chunks, `ctx` their mean
context, `forwards` the small forwards runtime/forward_plan.plan packs them into; a prefill
chunk of `tokens` at context `ctx` runs a fraction `frac` of the layers this step (a chunk may be
split by layers over several steps: runtime/scheduler.py). Steps without prefill refit the decode
part; steps with prefill refit the prefill part on what the decode part leaves. Predictions are
clamped to be positive, and the priors are deliberately slow (a 2-core CPU's figures) so the
first steps, before any fit, err towards smaller chunks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from prescient.runtime.linear import BATCH_INVARIANT_M


class RecursiveLeastSquares:
    """theta minimising sum_t lambda^(T-t) (y_t - x_t . theta)^2 + (theta - prior)' P0^-1 (theta -
    prior), updated one sample at a time: least squares with forgetting, and the prior a ridge
    that is never forgotten.

    Why the ridge stays: with plain forgetting, a direction the features do not move along (a
    phase of one-row decode steps: the intercept and the per-row cost always appear summed) loses
    its information by 1/lambda a step, its covariance winds up, and the first step that moves
    along it throws theta anywhere (measured under load: docs/SCHEDULING.md). Here the
    information matrix R = P0^-1 + sum_t lambda^(T-t) x_t x_t' never falls below the prior's, so
    the covariance stays bounded by P0; where the data speak (tens of steps) they outweigh it.

    Plain Python floats, not numpy: the engine updates it once a step, right after a forward
    streamed the weights through the caches, where numpy's ~15 small-array calls made a step's
    `observe` cost ~0.15 ms (a fortieth of a decode step); these float operations (an n <= 3
    solve) cost a few tens of microseconds."""

    def __init__(self, prior: list[float], prior_scale: float | list[float] = 1.0, forgetting: float = 0.95):
        self.prior = [float(v) for v in prior]
        self.theta = list(self.prior)
        n = len(self.theta)
        scales = [float(prior_scale)] * n if isinstance(prior_scale, (int, float)) else [float(v) for v in prior_scale]
        if len(scales) != n:
            raise ValueError(f"prior_scale has {len(scales)} entries for {n} coefficients")
        # The prior's covariance P0 in units of the observation noise's variance: (how far theta
        # may be from the prior / how noisy one step's time is)^2. Step times vary by ~5-10 ms
        # and the coefficients are ms-sized, so O(1): one step already moves theta most of the
        # way along its features, as it should when the priors are another machine's.
        # Per coefficient: a context term gets a tight prior, since within one prompt context and
        # token count grow together and the fit would otherwise trade one against the other.
        self.prior_info = [1.0 / v for v in scales]  # P0^-1, diagonal
        self.R = [[self.prior_info[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.b = [w * t for w, t in zip(self.prior_info, self.prior)]  # R theta = b
        self.forgetting = forgetting
        self.num_samples = 0

    def predict(self, x) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x, y: float) -> None:
        x = [float(v) for v in x]
        n = len(self.theta)
        if len(x) != n:
            raise ValueError(f"x has {len(x)} features, the fit {n}")
        y = float(y)
        if not (math.isfinite(y) and all(math.isfinite(v) for v in x)):
            return  # a degenerate sample would poison every later prediction: skipped
        # R_T = lam R_(T-1) + (1 - lam) P0^-1 + x x', b_T likewise: the data's weights decay by
        # lam a step while the prior's stay whole
        lam, keep = self.forgetting, 1.0 - self.forgetting
        R = [[lam * self.R[i][j] + x[i] * x[j] + (keep * self.prior_info[i] if i == j else 0.0) for j in range(n)]
             for i in range(n)]
        b = [lam * self.b[i] + x[i] * y + keep * self.prior_info[i] * self.prior[i] for i in range(n)]
        theta = _solve(R, b)
        if theta is None or not all(math.isfinite(v) for v in theta):
            return
        self.R, self.b, self.theta = R, b, theta
        self.num_samples += 1


def _solve(A: list[list[float]], b: list[float]) -> list[float] | None:
    """x with A x = b for a small symmetric positive definite A (Gaussian elimination with partial
    pivoting on copies); None if A is singular to working precision."""
    n = len(b)
    M = [list(row) + [v] for row, v in zip(A, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        if not abs(M[p][c]) > 1e-300:
            return None
        M[c], M[p] = M[p], M[c]
        for r in range(c + 1, n):
            f = M[r][c] / M[c][c]
            if f:
                M[r] = [a - f * v for a, v in zip(M[r], M[c])]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (M[r][n] - sum(M[r][k] * x[k] for k in range(r + 1, n))) / M[r][r]
    return x


@dataclass
class StepShape:
    """What a step carries, as the cost model reads it."""

    decode_rows: int = 0  # decode / verify rows (tree nodes) and short chunks: the small forwards
    decode_ctx: float = 0.0  # their mean context length
    # tokens of prefill chunks (forwards of their own), each weighted by the
    # fraction of the layers it runs this step (a chunk split by layers): token-equivalents of a
    # whole forward
    prefill_tokens: float = 0
    prefill_ctx: float = 0.0  # the chunks' mean context at their middle
    # the small forwards the decode rows take (runtime/forward_plan.plan's packing); 0: ceil(rows / M)
    decode_forwards: int = 0


class StepCostModel:
    """Predicted step seconds for a StepShape; `observe` refits from a measured step."""

    # seconds; a 2-core AVX2 machine's order of magnitude (a decode row ~1 ms, a prompt token
    # ~2 ms through every layer): slower than most machines, so early budgets are conservative
    DECODE_PRIOR = [0.004, 0.001, 0.0002]
    PREFILL_PRIOR = [0.002, 0.0004]

    def __init__(self, packed: bool = True):
        """packed: the small rows run in forwards of at most BATCH_INVARIANT_M rows, each another
        pass over the weights (the CPU's plan); False: in one forward (the device plan)."""
        self.packed = packed
        self.decode = RecursiveLeastSquares(self.DECODE_PRIOR, prior_scale=[1.0, 0.25, 0.01])
        self.prefill = RecursiveLeastSquares(self.PREFILL_PRIOR, prior_scale=[0.25, 0.005])

    def _forwards(self, rows: int, forwards: int) -> int:
        """The small forwards `rows` rows take: `forwards` as packed (0: ceil(rows / M)), at least
        one; one where every row runs in one forward."""
        if not self.packed:
            return 1
        return max(1, forwards or -(-rows // BATCH_INVARIANT_M))

    def _decode_x(self, shape: StepShape) -> list[float]:
        # the intercept once per small forward
        return [float(self._forwards(shape.decode_rows, shape.decode_forwards)), shape.decode_rows,
                shape.decode_rows * shape.decode_ctx / 1000]

    @staticmethod
    def _prefill_x(tokens: float, ctx: float) -> list[float]:
        return [tokens, tokens * ctx / 1000]

    def decode_seconds(self, rows: int, ctx: float, forwards: int = 0) -> float:
        """The decode part for `rows` rows at mean context `ctx` in `forwards` small forwards
        (0: ceil(rows / BATCH_INVARIANT_M)). Never cheaper with more rows: the intercept is
        taken at >= 0 and a row at >= a tenth of the prior's (a line fitted to a flat stretch
        can slope down, and the scheduler's searches need the cost to grow with the rows)."""
        d0, d1, d2 = self.decode.theta
        p0, p1, p2 = self.DECODE_PRIOR
        per_row = max(d1 + d2 * ctx / 1000, 0.1 * (p1 + p2 * ctx / 1000))
        return max(p0 * 0.1, max(d0, 0.0) * self._forwards(rows, forwards) + per_row * rows)

    def rows_seconds(self, rows: int, ctx_sum: float, forwards: int = 0) -> float:
        """decode_seconds of `rows` rows whose contexts sum to `ctx_sum` (step_shape's
        decode_rows and decode_rows * decode_ctx) in `forwards` small forwards: what the
        scheduler prices a step's small forwards by as it adds short chunks and draft rows to
        them, each at its own context."""
        return self.decode_seconds(rows, ctx_sum / rows if rows else 0.0, forwards)

    def prefill_seconds(self, tokens: int, ctx: float, frac: float = 1.0) -> float:
        """A chunk of `tokens` at mean context `ctx` through `frac` of the layers."""
        if tokens <= 0 or frac <= 0:
            return 0.0
        # plain floats, not a numpy dot: the scheduler asks this for every waiting prompt a step
        p0, p1 = self.prefill.theta
        per_token = max(self.PREFILL_PRIOR[0] * 0.02, p0 + p1 * ctx / 1000)
        return per_token * tokens * frac

    def predict(self, shape: StepShape) -> float:
        return (self.decode_seconds(shape.decode_rows, shape.decode_ctx, shape.decode_forwards)
                + self.prefill_seconds(shape.prefill_tokens, shape.prefill_ctx))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        # one outlier (a page fault storm, a descheduled thread) moves the fit at most 3x: a
        # machine that really got slower is followed within a few steps all the same
        seconds = min(seconds, 3 * self.predict(shape) + 0.02)
        if shape.prefill_tokens > 0:
            rest = seconds - self.decode_seconds(shape.decode_rows, shape.decode_ctx, shape.decode_forwards)
            self.prefill.update(self._prefill_x(shape.prefill_tokens, shape.prefill_ctx),
                                max(rest, 0.0))
        elif shape.decode_rows:
            self.decode.update(self._decode_x(shape), seconds)


def step_shape(seqs, num_layers: int, small_m: int = BATCH_INVARIANT_M) -> StepShape:
    """The StepShape of a scheduled step (ScheduledSeqs): decode rows with their draft slots
    and chunks of at most `small_m` tokens in the small forwards (runtime/forward_plan.py),
    longer chunks by the fraction of layers they run."""
    shape = StepShape()
    dctx = pctx = 0.0
    small: list[int] = []
    for seq in seqs:
        r = seq.request
        rows = seq.num_new_tokens + seq.num_spec_slots
        if seq.num_new_tokens <= small_m and seq.layers is None:
            shape.decode_rows += rows
            dctx += rows * (r.num_computed_tokens + rows)
            small.append(rows)
        else:
            frac = 1.0 if seq.layers is None else (seq.layers[1] - seq.layers[0]) / num_layers
            weight = seq.num_new_tokens * frac
            shape.prefill_tokens += weight
            pctx += weight * (r.num_computed_tokens + seq.num_new_tokens / 2)
    shape.decode_forwards = packed_forwards(small, small_m)
    if shape.decode_rows:
        shape.decode_ctx = dctx / shape.decode_rows
    if shape.prefill_tokens:
        shape.prefill_ctx = pctx / shape.prefill_tokens
    return shape


def shape_after_cut(shape: StepShape, seq, planned: tuple[int, int], num_layers: int) -> StepShape:
    """`shape` (step_shape's, at schedule time) with a split chunk's layers run as `seq.layers`
    says, not as `planned`: the layers the step's cutoff left for later taken out (the chunk did
    not complete, so its context is the one step_shape read)."""
    r = seq.request
    removed = seq.num_new_tokens * ((planned[1] - planned[0]) - (seq.layers[1] - seq.layers[0])) / num_layers
    tokens = shape.prefill_tokens - removed
    ctx_sum = shape.prefill_ctx * shape.prefill_tokens - removed * (r.num_computed_tokens + seq.num_new_tokens / 2)
    return dataclasses.replace(shape, prefill_tokens=tokens, prefill_ctx=ctx_sum / tokens if tokens > 0 else 0.0)


def packed_forwards(rows: list[int], m: int = BATCH_INVARIANT_M) -> int:
    """How many forwards runtime/forward_plan.plan runs these small sequences' rows in (in
    order): one of its own for more than `m` rows, the rest packed in order, a new forward
    whenever the next would not fit."""
    forwards = fill = 0
    for n in rows:
        if n > m:
            forwards += 1
            continue
        if fill and fill + n > m:
            forwards += 1
            fill = 0
        fill += n
    return forwards + (1 if fill else 0)
