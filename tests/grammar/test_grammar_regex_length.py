"""A pattern intersected with minLength/maxLength (grammar/schema/regex_length.py): never looser
than the pattern and the lengths, exactly the intersection where it says so, and empty only when
no string of the pattern has such a length (fuzzed against Python's `re`)."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from prescient.grammar.schema.merge import Unmergeable
from prescient.grammar.schema.regex_length import restrict_pattern

_ALPHABET = "ab1"
_STRINGS = [""] + ["".join(t) for n in range(1, 6) for t in itertools.product(_ALPHABET, repeat=n)]


def _py(pattern: str) -> re.Pattern:
    return re.compile(pattern.replace("\\d", "[0-9]").replace("[\\s\\S]", "(?s:.)"))


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 1 or roll < 0.4:
        atom = rng.choice(["a", "b", "[ab]", ".", "\\d"])
    elif roll < 0.7:
        body = "".join(_random_pattern(rng, depth + 1) for _ in range(rng.randint(2, 3)))
        atom = f"(?:{body})" if rng.random() < 0.5 else f"({body})"
    else:
        atom = "(" + "|".join(_random_pattern(rng, depth + 1) for _ in range(2)) + ")"
    return atom + rng.choice(["", "", "*", "+", "?", "{1,2}", "{2}", "{0,3}", "{2,}"])


def test_fuzzed_patterns_stay_within_pattern_and_lengths():
    rng = random.Random(7)
    checked = exact_checked = 0
    for _ in range(250):
        body = "".join(_random_pattern(rng) for _ in range(rng.randint(1, 3)))
        pattern = rng.choice([f"^{body}$", body, f"^{body}", f"{body}|b$"])
        low = rng.randint(0, 4)
        high = rng.choice([None, rng.randint(low, 6), rng.randint(0, 3)])
        try:
            out = restrict_pattern(pattern, low, high)
        except Unmergeable:
            continue
        in_range = lambda s: low <= len(s) and (high is None or len(s) <= high)  # noqa: E731
        original = _py(pattern)
        if out is None:  # a proof: no string the pattern finds has such a length
            assert not any(in_range(s) and original.search(s) for s in _STRINGS), (pattern, low, high)
            continue
        lowered = _py(out.pattern)
        checked += 1
        for s in _STRINGS:
            matched = bool(lowered.fullmatch(s))
            assert not matched or (in_range(s) and original.search(s)), (pattern, low, high, out, s)
            if out.exact:
                wanted = original.search(s) if out.searched else original.fullmatch(s)
                assert matched or not (in_range(s) and wanted), (pattern, low, high, out, s)
        exact_checked += out.exact
    assert checked > 100 and exact_checked > 30  # the fuzz exercised both kinds


@pytest.mark.parametrize("pattern,low,high,expected,exact", [
    ("^[a-z]+$", 0, 3, "^[a-z]{1,3}$", True),
    ("^IGF[a-zA-Z0-9-_]+$", 0, 50, "^IGF[a-zA-Z0-9-_]{1,47}$", True),  # fixed parts leave 47
    ("^[0-9a-f]{8}-[0-9a-f]{4}$", 13, 13, "^[0-9a-f]{8}-[0-9a-f]{4}$", True),  # already within
    ("^a", 3, None, "^(?:a)[\\s\\S]{2,}$", True),  # read as a search: "abc" is valid
    ("(^[a-z]+)|(^[0-9]+)", 0, 2, "^(?:[a-z]{1,2}|[0-9]{1,2})$", True),  # anchors inside groups
    ("^[a-z]+-[a-z]+$", 0, 9, "^[a-z]{1,4}-[a-z]{1,4}$", False),  # two variable parts: split
])
def test_length_budget_goes_where_the_pattern_allows(pattern, low, high, expected, exact):
    out = restrict_pattern(pattern, low, high)
    assert out is not None and out.pattern == expected and out.exact == exact


def test_empty_intersection_is_a_proof():
    assert restrict_pattern("^[a-z]{3}$", 0, 2) is None
    assert restrict_pattern("^a", 0, 0) is None  # even read as a search
    assert restrict_pattern("a", 5, 7) is not None  # "a" found inside a longer string


@pytest.mark.parametrize("pattern", ["a\\1", "(?=a)a", "a{2", "\\bword"])
def test_unreadable_patterns_are_left_alone(pattern):
    with pytest.raises(Unmergeable):
        restrict_pattern(pattern, 1, 4)
