"""Greedy best-fit offset packing over several orders (the TFLite / XLA practice).

Buffers are placed one by one, each in the tightest gap left by the already placed buffers it
overlaps in time (or on top of them). The overlap query uses an index over *ranks* of the time
values (their position among all start and end times), bucketed ``_BUCKET`` ranks at a time, so the
cost depends on the number of buffers and on how many are live together, never on the span of the
time values.
"""

from __future__ import annotations

import numpy as np

from dctms.toolkit.pack.problem import Problem, Sweep

_BUCKET = 64  # ranks per bucket of the overlap index
_NO_FIT = np.iinfo(np.int64).max


def greedy_orders(p: Problem) -> list[np.ndarray]:
    """The orders tried, best first on typical graphs (ties broken by index: deterministic)."""
    idx = np.arange(p.n)
    length = p.end - p.start
    return [
        np.lexsort((idx, -p.end, -p.size)),  # by size, late ends first
        np.lexsort((idx, p.start, -p.size)),  # by size, early starts first
        np.lexsort((idx, -p.size, -length)),  # by lifetime length
        np.lexsort((idx, -p.size, p.start)),  # by start
    ]


def best_fit(p: Problem, sw: Sweep, order: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets and arena of placing buffers in ``order``, each in its tightest fitting gap."""
    placed = best_fit_within(p, sw, order, None)
    assert placed is not None  # no limit
    return placed[0], placed[1]


def best_fit_within(
    p: Problem, sw: Sweep, order: np.ndarray, limit: int | None
) -> tuple[np.ndarray, int, int] | None:
    """``best_fit`` with its work (candidates examined) counted; None as soon as the work passes
    ``limit``. A placement examines every placed buffer it may overlap in time, so with many
    buffers live together the pass is quadratic (40,000 live at once: 8 * 10^8 candidates)."""
    n = p.n
    work = 0
    starts, ends = p.start, p.end
    first_bucket = (sw.sec_lo // _BUCKET).tolist()
    last_bucket = (np.maximum(sw.sec_hi - 1, sw.sec_lo) // _BUCKET).tolist()
    lo = np.zeros(n, dtype=np.int64)
    hi = np.zeros(n, dtype=np.int64)
    # Per bucket: every placed buffer live in it, and those whose first bucket it is. A query
    # takes all of its first bucket and the "homed" ones of the next: each candidate once.
    every: dict[int, list[int]] = {}
    homed: dict[int, list[int]] = {}
    offsets = np.zeros(n, dtype=np.int64)
    arena = 0
    s_list, e_list = starts.tolist(), ends.tolist()
    z_list, a_list = p.size.tolist(), p.align.tolist()
    for i in order.tolist():
        first, last = first_bucket[i], last_bucket[i]
        near = every.get(first, [])
        if first != last:
            near = near + [j for b in range(first + 1, last + 1) for j in homed.get(b, ())]
        offset = 0
        work += len(near) + last - first + 1  # the candidates, and the buckets' lists below
        if limit is not None and work > limit:
            return None
        if near:
            cand = np.array(near, dtype=np.int64)
            cand = cand[(starts[cand] < e_list[i]) & (s_list[i] < ends[cand])]
            if cand.size:
                offset = _best_gap(np.sort(cand), lo, hi, z_list[i], a_list[i])
        offsets[i] = offset
        top = offset + z_list[i]
        lo[i], hi[i] = offset, top
        homed.setdefault(first, []).append(i)
        for b in range(first, last + 1):
            every.setdefault(b, []).append(i)
        if top > arena:
            arena = top
    return offsets, arena, work


def _best_gap(
    cand: np.ndarray, lo_all: np.ndarray, hi_all: np.ndarray, size: int, align: int
) -> int:
    """Start of the lowest-waste gap of at least ``size`` between the candidates' byte ranges
    (candidates in index order, ties in offset kept in it), else the aligned top of them all."""
    lo = lo_all[cand]
    if lo.size > 1:
        order = np.argsort(lo, kind="stable")
        lo = lo[order]
        tops = np.maximum.accumulate(hi_all[cand[order]])
    else:
        tops = hi_all[cand]
    # Gap before range k: from the highest end of the ranges below it (aligned) up to lo[k].
    gap_start = np.empty_like(lo)
    gap_start[0] = 0
    gap_start[1:] = tops[:-1]
    if align > 1:
        gap_start = -(-gap_start // align) * align
    gap = lo - gap_start
    gap[gap < size] = _NO_FIT
    k = int(gap.argmin())
    if gap[k] != _NO_FIT:
        return int(gap_start[k])
    top = int(tops[-1])
    return -(-top // align) * align
