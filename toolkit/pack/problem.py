"""The offset-packing problem (dynamic storage allocation) as plain arrays, and what every packer needs.

A problem is a set of buffers, each live over the half-open time range ``[start, end)`` and
``size`` bytes large, whose offset must be a multiple of its ``align``. A packing gives each buffer
an offset so that buffers live at the same time never share bytes; its arena is the highest byte
used. Everything here depends on the number of buffers only, never on how far apart the time
values are: times are only ever sorted and compared.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    start: np.ndarray  # int64, first time the buffer is live
    end: np.ndarray  # int64, first time it is dead again (end > start)
    size: np.ndarray  # int64 bytes (>= 0)
    align: np.ndarray  # int64 offset alignment (>= 1)

    @property
    def n(self) -> int:
        return int(self.size.size)


def make_problem(
    start: list[int] | np.ndarray,
    end: list[int] | np.ndarray,
    size: list[int] | np.ndarray,
    align: list[int] | np.ndarray | int = 1,
) -> Problem:
    n = len(size)
    al = np.full(n, align, dtype=np.int64) if isinstance(align, int) else np.asarray(align)
    return Problem(
        np.asarray(start, dtype=np.int64).reshape(n),
        np.asarray(end, dtype=np.int64).reshape(n),
        np.asarray(size, dtype=np.int64).reshape(n),
        al.astype(np.int64).reshape(n),
    )


def live_max(p: Problem) -> int:
    """Max over time of the bytes live at once: no packing has a smaller arena.

    A sweep over the sorted 2n events (ends sort before starts at the same time, since
    ``[start, end)`` is half-open): O(n log n) whatever the span of the time values.
    """
    if p.n == 0:
        return 0
    times = np.concatenate((p.end, p.start))
    change = np.concatenate((-p.size, p.size))
    order = np.lexsort((change, times))  # by time, then the removals (negative) first
    return max(0, int(np.cumsum(change[order]).max()))


def granule(p: Problem) -> int:
    """The gcd of all sizes and alignments: every offset and arena is a multiple of it."""
    g = int(np.gcd.reduce(np.concatenate((p.size, p.align)))) if p.n else 1
    return max(g, 1)


def aligned_top(top: np.ndarray | int, align: np.ndarray | int) -> np.ndarray | int:
    """``top`` rounded up to a multiple of ``align``."""
    return -(-top // align) * align


@dataclass(frozen=True)
class Sweep:
    """Time cut into sections (maximal ranges in which the live set does not change).

    ``sec_lo[b] .. sec_hi[b]`` (half-open) are the sections buffer b is live in; ``parts`` lists the
    independent sub-problems: groups of buffers no buffer outside the group overlaps in time, as
    (buffer indices, first section, last section + 1).
    """

    sec_lo: np.ndarray
    sec_hi: np.ndarray
    n_sections: int
    parts: list[tuple[np.ndarray, int, int]]


def sweep(p: Problem) -> Sweep:
    points = np.unique(np.concatenate((p.start, p.end)))
    sec_lo = np.searchsorted(points, p.start)
    sec_hi = np.searchsorted(points, p.end)
    n_sections = max(len(points) - 1, 0)
    # A cut at section k: no buffer covers both k-1 and k. Coverage via a difference array.
    order = np.argsort(sec_lo, kind="stable")
    reach = np.maximum.accumulate(sec_hi[order]) if p.n else sec_hi
    parts: list[tuple[np.ndarray, int, int]] = []
    first = 0
    for k in range(1, p.n + 1):
        # buffers order[first:k] form a part when the next one starts at or after their reach
        if k == p.n or sec_lo[order[k]] >= reach[k - 1]:
            members = np.sort(order[first:k])
            parts.append((members, int(sec_lo[order[first]]), int(reach[k - 1])))
            first = k
    return Sweep(sec_lo, sec_hi, n_sections, parts)


def part_arena(p: Problem, offsets: np.ndarray, members: np.ndarray) -> int:
    return int((offsets[members] + p.size[members]).max()) if members.size else 0


def is_valid(p: Problem, offsets: np.ndarray) -> bool:
    """Offsets aligned, non-negative and disjoint for buffers live together (a sweep, n log n)."""
    if p.n == 0:
        return True
    if (offsets < 0).any() or (offsets % p.align).any():
        return False
    order = np.argsort(p.start, kind="stable")
    live: list[tuple[int, int]] = []  # sorted (offset, top) of live non-empty buffers
    expiry: list[tuple[int, int, int]] = []
    for i in order.tolist():
        s = int(p.start[i])
        while expiry and expiry[0][0] <= s:
            _, lo, hi = heapq.heappop(expiry)
            del live[bisect.bisect_left(live, (lo, hi))]
        lo, hi = int(offsets[i]), int(offsets[i] + p.size[i])
        if hi == lo:
            continue
        k = bisect.bisect_left(live, (lo, hi))
        if k < len(live) and live[k][0] < hi:
            return False
        if k > 0 and live[k - 1][1] > lo:
            return False
        live.insert(k, (lo, hi))
        heapq.heappush(expiry, (int(p.end[i]), lo, hi))
    return True
