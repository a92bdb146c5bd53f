"""A fractional `multipleOf` (0.01, 0.25) on numbers, rewritten into what xgrammar enforces
(used by lower.py). xgrammar enforces `multipleOf` only as a whole number on integers.

What a value must satisfy is what `jsonschema` computes (the compliance check's judge): for a
float step, `instance / step` in binary floating point must be a whole number; 0.07 / 0.01 is
7.000000000000001, so 0.07 is not a multiple of 0.01 there. Two rewrites agree with it:

- a bounded range with at most 1000 multiples: the multiples themselves, as an `enum`, each
  kept only if that float division says it is one. Exact when the step is a binary fraction
  (0.5, 0.25: division by it only scales, so the listed values are all the floats that pass);
  narrower otherwise (some float other than k * step may also pass the division);
- otherwise the integers that are multiples of the step's numerator p (step = p / q in lowest
  terms: n / step = n * q / p), within |n / step| < 2**53 (narrower: no fractions). They pass
  the float division: with step's float error e (|e| <= 2**-54, checked; 0.1's is 2**-54), n / float(step) is
  N / (1 + e) for the whole number N = n * q / p, closer to N than half a unit in the last
  place of N, so it rounds to N exactly.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from prescient.grammar.schema.merge import Unmergeable

_MAX_VALUES = 1000
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def fractional_step(node: dict) -> bool:
    """A `multipleOf` that is not a whole number, on a node that can only be a number."""
    step = node.get("multipleOf")
    if isinstance(step, bool) or not isinstance(step, float) or not math.isfinite(step) or step <= 0:
        return False
    if step.is_integer():
        return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    return isinstance(types, list) and bool(types) and set(types) <= {"number", "integer"}


def fractional_steps(lw, node: dict, exact: bool) -> Any:
    """The rewritten node (False when no number in its range passes); with `exact`, only the
    exact rewrite, else Unmergeable."""
    step = node["multipleOf"]
    exact_step = Fraction(repr(step))  # the decimal the author wrote
    low, low_x, high, high_x = _bounds(node)
    rest = {k: v for k, v in node.items() if k not in ("multipleOf", "type", *_BOUNDS)}
    if low is not None and high is not None:
        k_lo = math.ceil(Fraction(low) / exact_step)
        k_hi = math.floor(Fraction(high) / exact_step)
        if k_hi - k_lo + 1 <= _MAX_VALUES:
            values = []
            for k in range(k_lo, k_hi + 1):
                v = float(k * exact_step)
                if v.is_integer():
                    v = int(v)
                if _inside(v, low, low_x, high, high_x) and _passes(v, step) and (
                        "integer" not in _types(node) or "number" in _types(node) or float(v).is_integer()):
                    values.append(v)
            if not values:
                return False  # no number in range passes
            if exact_step.denominator & (exact_step.denominator - 1) or Fraction(step) != exact_step:
                if exact:
                    raise Unmergeable("listed multiples are narrower here")
                lw.note("fractional multipleOf (listed multiples)")
            return {**rest, "enum": values}
    # whole multiples of p, where n / step = n * q / p
    if exact:
        raise Unmergeable("integer multiples are narrower")
    p = exact_step.numerator
    fl = Fraction(step)
    if abs(fl - exact_step) / exact_step > Fraction(1, 2 ** 54):
        raise Unmergeable("the step's float is too far from its decimal")
    # |n / step| below 2**53, and n itself (a float exactly)
    limit = min(2 ** 53 - 1, int(Fraction(2 ** 53 - 1) * exact_step))
    lo_n = -limit if low is None else max(-limit, _first_int(low, low_x))
    hi_n = limit if high is None else min(limit, _last_int(high, high_x))
    lw.note("fractional multipleOf (integers)")
    out = {**rest, "type": "integer", "minimum": lo_n, "maximum": hi_n}
    if p > 1:
        out["multipleOf"] = p
    return out


def _types(node: dict) -> set:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t)


def _passes(value, step: float) -> bool:
    """jsonschema's test for a float step."""
    quotient = value / step
    try:
        return int(quotient) == quotient
    except (OverflowError, ValueError):
        return False


def _inside(v, low, low_x, high, high_x) -> bool:
    if low is not None and (v < low or (low_x and v == low)):
        return False
    return not (high is not None and (v > high or (high_x and v == high)))


def _first_int(low, exclusive: bool) -> int:
    n = math.ceil(low)
    return n + 1 if exclusive and n == low else n


def _last_int(high, exclusive: bool) -> int:
    n = math.floor(high)
    return n - 1 if exclusive and n == high else n


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds(node: dict) -> tuple:
    """(low, low exclusive, high, high exclusive), draft-4 boolean exclusives included."""
    low = high = None
    low_x = high_x = False
    if _num(node.get("minimum")):
        low, low_x = node["minimum"], node.get("exclusiveMinimum") is True
    if _num(node.get("exclusiveMinimum")) and (low is None or node["exclusiveMinimum"] >= low):
        low, low_x = node["exclusiveMinimum"], True
    if _num(node.get("maximum")):
        high, high_x = node["maximum"], node.get("exclusiveMaximum") is True
    if _num(node.get("exclusiveMaximum")) and (high is None or node["exclusiveMaximum"] <= high):
        high, high_x = node["exclusiveMaximum"], True
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if node.get(key) not in (None, True, False) and not _num(node.get(key)):
            raise Unmergeable(f"'{key}' is not a number")
    return low, low_x, high, high_x
