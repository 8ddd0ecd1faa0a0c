"""Pass 4, assign: physical buffers (the paper's interval colouring) and offsets in one arena.

* ``colour``: tensors whose intervals are disjoint may share a buffer; greedy by start time gives
  the minimum number of buffers for an interval graph (Golumbic), each sized to its largest tenant.
  Among free buffers we pick the best fit by size, which keeps the buffers' total small too.
* ``pack``: offsets in a single arena, greedy best-fit over several orders (by size with late ends
  first, by size, by lifetime length, by start), keeping the smallest arena (the TFLite/XLA practice); offsets and sizes are
  rounded up to the alignment.
* ``lower_bound``: max over slots of the aligned bytes live in that slot: no packing can beat it.

Intervals are inclusive slot ranges ``(s, e)``; two tensors conflict when ``a0 <= b1 and b0 <= a1``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np

from dctms.schema.sizes import align_up, live_bytes

_BUCKET = 32  # slots per time bucket of the packer's index


def colour(
    intervals: Sequence[tuple[int, int]], sizes: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Buffer index per tensor and each buffer's size (its largest tenant)."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -sizes[i], i))
    busy: list[tuple[int, int]] = []  # heap of (end, buffer)
    free_sizes: list[tuple[int, int]] = []  # sorted (size, buffer) of free buffers
    buffer_of = [0] * len(intervals)
    buffer_size: list[int] = []
    for i in order:
        s, e = intervals[i]
        while busy and busy[0][0] < s:
            _, b = heapq.heappop(busy)
            bisect.insort(free_sizes, (buffer_size[b], b))
        if free_sizes:
            # Best fit: the smallest free buffer that holds it, else the largest (grown to fit).
            k = bisect.bisect_left(free_sizes, (sizes[i], -1))
            if k == len(free_sizes):
                k -= 1
            _, b = free_sizes.pop(k)
            buffer_size[b] = max(buffer_size[b], sizes[i])
        else:
            b = len(buffer_size)
            buffer_size.append(sizes[i])
        buffer_of[i] = b
        heapq.heappush(busy, (e, b))
    return buffer_of, buffer_size


def lower_bound(intervals: Sequence[tuple[int, int]], sizes: Sequence[int], n_slots: int) -> int:
    """Max over slots of live bytes (sizes already aligned): schema's one live-bytes sweep."""
    spans = ((s, e, size) for (s, e), size in zip(intervals, sizes, strict=True))
    return max(live_bytes(spans, n_slots), default=0)


def pack(
    intervals: Sequence[tuple[int, int]],
    sizes: Sequence[int],
    alignment: int,
    floor: int = 0,
) -> tuple[list[int], int]:
    """Arena offsets per tensor and the arena size; best of several greedy orders.

    ``floor``: a known lower bound; an order that reaches it is optimal and ends the search."""
    n = len(intervals)
    if n == 0:
        return [], 0
    aligned = [align_up(sz, alignment) for sz in sizes]
    orders = [
        sorted(range(n), key=lambda i: (-aligned[i], -intervals[i][1], i)),
        sorted(range(n), key=lambda i: (-aligned[i], intervals[i][0], i)),
        sorted(range(n), key=lambda i: (-(intervals[i][1] - intervals[i][0]), -aligned[i], i)),
        sorted(range(n), key=lambda i: (intervals[i][0], -aligned[i], i)),
    ]
    best: tuple[int, list[int]] | None = None
    for order in orders:
        offsets, arena = _greedy_best_fit(order, intervals, aligned)
        if best is None or arena < best[0]:
            best = (arena, offsets)
        if arena <= floor:
            break
    return best[1], best[0]


def _greedy_best_fit(
    order: Sequence[int], intervals: Sequence[tuple[int, int]], aligned: Sequence[int]
) -> tuple[list[int], int]:
    """Place tensors in ``order``, each in the tightest gap among the placed tensors it overlaps.

    Placed tensors are indexed by time buckets of ``_BUCKET`` slots, so a query only looks at
    tensors near its own interval: near-linear for the short lifetimes of real graphs.
    """
    n = len(intervals)
    starts = np.array([s for s, _ in intervals], dtype=np.int64)
    ends = np.array([e for _, e in intervals], dtype=np.int64)
    lo = np.zeros(n, dtype=np.int64)
    hi = np.zeros(n, dtype=np.int64)
    buckets: dict[int, list[int]] = {}
    offsets = [0] * n
    arena = 0
    for i in order:
        s, e = intervals[i]
        first, last = s // _BUCKET, e // _BUCKET
        near = [j for b in range(first, last + 1) for j in buckets.get(b, ())]
        if near:
            cand = np.unique(np.fromiter(near, dtype=np.int64, count=len(near)))
            cand = cand[(starts[cand] <= e) & (s <= ends[cand])]
            offset = _best_gap(lo[cand], hi[cand], aligned[i])
        else:
            offset = 0
        offsets[i] = offset
        lo[i], hi[i] = offset, offset + aligned[i]
        for b in range(first, last + 1):
            buckets.setdefault(b, []).append(i)
        arena = max(arena, offset + aligned[i])
    return offsets, arena


def _best_gap(lo: np.ndarray, hi: np.ndarray, size: int) -> int:
    """Lowest-waste gap of at least ``size`` between occupied ranges, else the top."""
    if lo.size == 0:
        return 0
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    tops = np.maximum.accumulate(hi)
    # Gap before range k: from the highest end of ranges before it to lo[k].
    gap_start = np.concatenate(([0], tops[:-1]))
    gap = lo - gap_start
    fits = np.nonzero(gap >= size)[0]
    if fits.size:
        k = fits[np.argmin(gap[fits])]
        return int(gap_start[k])
    return int(tops[-1])
