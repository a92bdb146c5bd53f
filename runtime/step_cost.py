"""What a step will cost, predicted from what steps have cost: the scheduler's time budget.

A step's wall time (schedule to commit, what every running stream waits between deliveries) is
modelled as two parts, each linear in a few features and refitted online by recursive least
squares (with forgetting, so a machine that gets busier is followed within tens of steps):

    decode(rows, ctx)          = d0 + d1 * rows + d2 * rows * ctx / 1000      every step
    prefill(tokens, ctx, frac) = frac * (p0 * tokens + p1 * tokens * ctx / 1000)

`rows` are the decode/verify rows (a draft tree's nodes), `ctx` their mean context; a prefill
chunk of `tokens` at context `ctx` runs a fraction `frac` of the layers this step (a chunk may be
split by layers over several steps: runtime/scheduler.py). Steps without prefill refit the decode
part; steps with prefill refit the prefill part on what the decode part leaves. Predictions are
clamped to be positive, and the priors are deliberately slow (a 2-core CPU's figures) so the
first steps, before any fit, err towards smaller chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prescient.runtime.linear import BATCH_INVARIANT_M


class RecursiveLeastSquares:
    """theta minimising sum_t lambda^(T-t) (y_t - x_t . theta)^2, updated one sample at a time.

    Plain Python floats, not numpy: the engine updates it once a step, right after a forward
    streamed the weights through the caches, where numpy's ~15 small-array calls made a step's
    `observe` cost ~0.15 ms (a fortieth of a decode step) and these float operations ~0.035 ms."""

    def __init__(self, prior: list[float], prior_scale: float | list[float] = 1.0, forgetting: float = 0.95):
        self.theta = [float(v) for v in prior]
        n = len(self.theta)
        scales = [float(prior_scale)] * n if isinstance(prior_scale, (int, float)) else [float(v) for v in prior_scale]
        if len(scales) != n:
            raise ValueError(f"prior_scale has {len(scales)} entries for {n} coefficients")
        # The prior's covariance in units of the observation noise's variance: (how far theta
        # may be from the prior / how noisy one step's time is)^2. Step times vary by ~5-10 ms
        # and the coefficients are ms-sized, so O(1): one step already moves theta most of the
        # way along its features, as it should when the priors are another machine's.
        # Per coefficient: a context term gets a tight prior, since within one prompt context and
        # token count grow together and the fit would otherwise trade one against the other.
        self.P = [[scales[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.forgetting = forgetting
        self.num_samples = 0

    def predict(self, x) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x, y: float) -> None:
        x = [float(v) for v in x]
        if len(x) != len(self.theta):
            raise ValueError(f"x has {len(x)} features, the fit {len(self.theta)}")
        lam, P, theta = self.forgetting, self.P, self.theta
        Px = [sum(p * v for p, v in zip(row, x)) for row in P]  # P x
        denom = lam + sum(p * v for p, v in zip(Px, x))
        if not (math.isfinite(denom) and denom > 0):
            return  # degenerate (x^T P x is >= 0 for a sound P): skipped, as a non-finite update
        err = y - sum(t * v for t, v in zip(theta, x))
        gain = [p / denom for p in Px]
        new_theta = [t + g * err for t, g in zip(theta, gain)]
        new_P = [[(P[i][j] - gain[i] * Px[j]) / lam for j in range(len(x))] for i in range(len(x))]
        if not all(math.isfinite(v) for v in new_theta) or not all(math.isfinite(v) for row in new_P for v in row):
            return  # a degenerate update (it would poison every later prediction): skip it
        # keep P bounded (a long run of identical features would blow it up through 1/lambda)
        self.theta = new_theta
        self.P = [[min(1e3, max(-1e3, v)) for v in row] for row in new_P]
        self.num_samples += 1


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


class StepCostModel:
    """Predicted step seconds for a StepShape; `observe` refits from a measured step."""

    # seconds; a 2-core AVX2 machine's order of magnitude (a decode row ~1 ms, a prompt token
    # ~2 ms through every layer): slower than most machines, so early budgets are conservative
    DECODE_PRIOR = [0.004, 0.001, 0.0002]
    PREFILL_PRIOR = [0.002, 0.0004]

    def __init__(self):
        self.decode = RecursiveLeastSquares(self.DECODE_PRIOR, prior_scale=[1.0, 0.25, 0.01])
        self.prefill = RecursiveLeastSquares(self.PREFILL_PRIOR, prior_scale=[0.25, 0.005])

    @staticmethod
    def _decode_x(shape: StepShape) -> list[float]:
        return [1.0, shape.decode_rows, shape.decode_rows * shape.decode_ctx / 1000]

    @staticmethod
    def _prefill_x(tokens: float, ctx: float) -> list[float]:
        return [tokens, tokens * ctx / 1000]

    def decode_seconds(self, rows: int, ctx: float) -> float:
        floor = self.DECODE_PRIOR[0] * 0.1
        return max(floor, self.decode.predict(self._decode_x(StepShape(rows, ctx))))

    def decode_rows_within(self, seconds: float, ctx: float) -> int:
        """The most decode/verify rows at mean context `ctx` predicted to fit `seconds` (>= 0);
        read off decode_seconds, linear in the rows."""
        base = self.decode_seconds(0, ctx)
        per_row = self.decode_seconds(1, ctx) - base
        if per_row <= 0:  # a fit that has not learnt a row's cost yet: the prior's
            per_row = self.DECODE_PRIOR[1] + self.DECODE_PRIOR[2] * ctx / 1000
        return max(0, int((seconds - base) / per_row))

    def prefill_seconds(self, tokens: int, ctx: float, frac: float = 1.0) -> float:
        """A chunk of `tokens` at mean context `ctx` through `frac` of the layers."""
        if tokens <= 0 or frac <= 0:
            return 0.0
        # plain floats, not a numpy dot: the scheduler asks this for every waiting prompt a step
        p0, p1 = self.prefill.theta
        per_token = max(self.PREFILL_PRIOR[0] * 0.02, p0 + p1 * ctx / 1000)
        return per_token * tokens * frac

    def predict(self, shape: StepShape) -> float:
        return (self.decode_seconds(shape.decode_rows, shape.decode_ctx)
                + self.prefill_seconds(shape.prefill_tokens, shape.prefill_ctx))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        # one outlier (a page fault storm, a descheduled thread) moves the fit at most 3x: a
        # machine that really got slower is followed within a few steps all the same
        seconds = min(seconds, 3 * self.predict(shape) + 0.02)
        if shape.prefill_tokens > 0:
            rest = seconds - self.decode_seconds(shape.decode_rows, shape.decode_ctx)
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
    for seq in seqs:
        r = seq.request
        rows = seq.num_new_tokens + seq.num_spec_slots
        if seq.num_new_tokens <= small_m and seq.layers is None:
            shape.decode_rows += rows
            dctx += rows * (r.num_computed_tokens + rows)
        else:
            frac = 1.0 if seq.layers is None else (seq.layers[1] - seq.layers[0]) / num_layers
            weight = seq.num_new_tokens * frac
            shape.prefill_tokens += weight
            pctx += weight * (r.num_computed_tokens + seq.num_new_tokens / 2)
    if shape.decode_rows:
        shape.decode_ctx = dctx / shape.decode_rows
    if shape.prefill_tokens:
        shape.prefill_ctx = pctx / shape.prefill_tokens
    return shape
