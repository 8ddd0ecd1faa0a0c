"""The packing an online allocator would make: buffers in order of their start time, each in the
best-fitting hole of the address space at that moment (the holes the buffers still live leave).

One pass over the 2n events with the holes kept sorted by size and by address, so its cost is
n log n plus the shifting of those lists, however many buffers are live together: the fallback
when greedy best-fit (``greedy``), which examines every placed buffer a placement may
overlap, would cost more than the budget allows (40,000 buffers live at once). It cannot see
ahead, so its arena is usually above greedy best-fit's; the search may lower it after.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from dctms.toolkit.pack.problem import Problem

# Holes smaller than size + align - 1 tried (smallest first) before the smallest one that surely
# holds the buffer: an alignment may make such a hole useless, and there may be many of them.
_HOLES_TRIED = 8


def online_best_fit(p: Problem) -> tuple[np.ndarray, int]:
    """Offsets and arena; ties in start time go largest first, then by index (deterministic)."""
    offsets = np.zeros(p.n, dtype=np.int64)
    holes = _Holes()
    live: list[tuple[int, int, int]] = []  # heap of (end, offset, top)
    arena = 0
    sizes, aligns, ends = p.size.tolist(), p.align.tolist(), p.end.tolist()
    for i in np.lexsort((np.arange(p.n), -p.size, p.start)).tolist():
        start, size = int(p.start[i]), sizes[i]
        while live and live[0][0] <= start:  # [start, end) is half-open: free before placing
            _, lo, hi = heapq.heappop(live)
            holes.free(lo, hi)
        if size == 0:
            continue  # occupies nothing: offset 0
        offset = holes.take(size, aligns[i])
        offsets[i] = offset
        heapq.heappush(live, (ends[i], offset, offset + size))
        arena = max(arena, offset + size)
    return offsets, arena


class _Holes:
    """Free byte ranges below ``top`` (everything from ``top`` up is free), merged when adjacent."""

    def __init__(self) -> None:
        self.top = 0
        self.by_size: list[tuple[int, int]] = []  # sorted (size, lo)
        self.end_of: dict[int, int] = {}  # lo -> hi
        self.start_of: dict[int, int] = {}  # hi -> lo

    def take(self, size: int, align: int) -> int:
        """The offset of the smallest hole that holds ``size`` bytes aligned (else the top)."""
        k = bisect.bisect_left(self.by_size, (size, -1))
        # A hole of at least size + align - 1 bytes always holds it; a smaller one may not.
        sure = bisect.bisect_left(self.by_size, (size + align - 1, -1))
        for j in [*range(k, min(sure, k + _HOLES_TRIED)), sure]:
            if j >= len(self.by_size):
                break
            length, lo = self.by_size[j]
            offset = -(-lo // align) * align
            if offset + size <= lo + length:
                self._remove(lo, lo + length)
                self._add(lo, offset)
                self._add(offset + size, lo + length)
                return offset
        offset = -(-self.top // align) * align
        self._add(self.top, offset)
        self.top = offset + size
        return offset

    def free(self, lo: int, hi: int) -> None:
        if hi in self.end_of:  # a hole starts where this range ends
            upper = self.end_of[hi]
            self._remove(hi, upper)
            hi = upper
        if lo in self.start_of:  # a hole ends where this range starts
            lower = self.start_of[lo]
            self._remove(lower, lo)
            lo = lower
        if hi == self.top:
            self.top = lo
        else:
            self._add(lo, hi)

    def _add(self, lo: int, hi: int) -> None:
        if hi > lo:
            bisect.insort(self.by_size, (hi - lo, lo))
            self.end_of[lo], self.start_of[hi] = hi, lo

    def _remove(self, lo: int, hi: int) -> None:
        del self.by_size[bisect.bisect_left(self.by_size, (hi - lo, lo))]
        del self.end_of[lo], self.start_of[hi]
