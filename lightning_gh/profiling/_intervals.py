"""Interval arithmetic over ``(start, end)`` pairs, for the trace analyses.

A *merged* list is sorted, with no two intervals touching or overlapping (what :func:`union` returns); the other
functions take and return merged lists.

Example::

    >>> from lightning_gh.profiling._intervals import intersect, length, subtract, union
    >>> busy = union([(0, 4), (3, 6), (8, 9)])
    >>> busy, length(busy)
    ([(0, 6), (8, 9)], 7)
    >>> subtract([(0, 10)], busy), intersect(busy, [(5, 8.5)])
    ([(6, 8), (9, 10)], [(5, 6), (8, 8.5)])
"""

from __future__ import annotations

import bisect
from typing import Iterable

__all__ = ["Interval", "clip", "gaps", "intersect", "length", "subtract", "union"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The merged union of any intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def clip(merged: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of a merged list inside ``[lo, hi]``."""
    starts = [a for a, _ in merged]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    out = []
    for a, b in merged[i:]:
        if a >= hi:
            break
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total length of a merged list."""
    return sum(b - a for a, b in intervals)


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Where two merged lists overlap."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(lo: float, hi: float, merged: list[Interval]) -> list[Interval]:
    """The parts of ``[lo, hi]`` that a merged list (already inside it) leaves uncovered."""
    out, cur = [], lo
    for a, b in merged:
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if hi > cur:
        out.append((cur, hi))
    return out


def subtract(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """The parts of merged list ``x`` not covered by merged list ``y``."""
    out = []
    for a, b in x:
        out += gaps(a, b, clip(y, a, b))
    return out
