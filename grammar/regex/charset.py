"""Sets of Unicode code points as sorted, disjoint (low, high) ranges: the one representation of
a character class in grammar/regex/, so every reader of a pattern agrees on what `[^a-z]` holds.
"""

from __future__ import annotations

Ranges = list  # [(low, high)] code points, sorted and disjoint

MAX_CHAR = 0x10FFFF
# what `.` leaves out (ECMA-262's line terminators)
LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]


def normalize(ranges: list[tuple[int, int]]) -> Ranges:
    """Sorted, with overlapping and adjacent ranges merged."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def complement(ranges: list[tuple[int, int]]) -> Ranges:
    """Every code point (0 to MAX_CHAR) outside `ranges`."""
    out, start = [], 0
    for low, high in normalize(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= MAX_CHAR:
        out.append((start, MAX_CHAR))
    return out


def intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> Ranges:
    out, i, j = [], 0, 0
    a, b = normalize(a), normalize(b)
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if low <= high:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(ranges: list[tuple[int, int]], remove: list[tuple[int, int]]) -> Ranges:
    return intersect(ranges, complement(remove))
