"""Pass 4, assign: physical buffers (the paper's interval colouring) and offsets in one arena.

* ``colour``: tensors whose intervals are disjoint may share a buffer; greedy by start time gives
  the minimum number of buffers for an interval graph (Golumbic), each sized to its largest tenant.
  Among free buffers we pick the best fit by size, which keeps the buffers' total small too.
* ``pack``: offsets in a single arena. Greedy best-fit over several orders first
  (``pack.greedy``, the TFLite/XLA practice); when the best order misses the lower bound, an exact
  branch-and-bound (``pack.search``) looks for a smaller arena within a work budget and may prove
  the result optimal. Offsets and sizes are rounded up to the alignment. The answer is kept on
  disk (``pack.memo``): packing the same phase again reads it.
* ``lower_bound``: max over slots of the aligned bytes live in that slot: no packing can beat it.

Intervals are inclusive slot ranges ``(s, e)``; two tensors conflict when ``a0 <= b1 and b0 <= a1``.
The packers themselves work on half-open ``[start, end)`` times (``pack.problem``).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from dctms.schema.sizes import align_up
from dctms.toolkit.pack.memo import cached_solve
from dctms.toolkit.pack.problem import live_max, make_problem
from dctms.toolkit.pack.solve import Packing, solve

__all__ = ["Packing", "align_up", "colour", "lower_bound", "pack", "solve"]


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


def lower_bound(
    intervals: Sequence[tuple[int, int]], sizes: Sequence[int], n_slots: int = 0
) -> int:
    """Max over slots of live bytes (sizes already aligned); costs n log n whatever the slot span."""
    starts = [s for s, _ in intervals]
    ends = [e + 1 for _, e in intervals]
    return live_max(make_problem(starts, ends, sizes))


def pack(
    intervals: Sequence[tuple[int, int]],
    sizes: Sequence[int],
    alignment: int,
    seconds: float = 0.0,
) -> Packing:
    """Arena offsets for tensors live over inclusive slot ranges; see ``solve`` (through the
    packing cache, ``pack.memo``: the same answer, packed once per machine)."""
    problem = make_problem(
        [s for s, _ in intervals],
        [e + 1 for _, e in intervals],
        [align_up(sz, alignment) for sz in sizes],
        alignment,
    )
    return cached_solve(problem, seconds)
