"""Skyline search: fill a part of a packing problem bottom-left, one lowest point at a time.

Time is cut into sections (``pack_problem.Sweep``); the *skyline* is, per section, the height below
which every byte is taken (by a placed buffer) or given up (waste). Each node looks at the lowest
point of the skyline, leftmost among equals: the section ``t0`` at height ``y``, in a flat run
``[t0, t1)`` of sections at that height. The sections on either side are higher (or the part
ends), so a buffer that covers that point must *start* at ``t0``, sit at offset ``y`` and end by
``t1``. The node branches on those buffers (few: usually one to three), then on giving the run up
as waste, raised to its lower neighbour. Per section, the bytes still to place plus the height must
stay within the capacity; a placement keeps that sum, only waste spends the section's *slack*
(capacity minus the bytes live there). Identical unplaced buffers are tried once per node.

With no slack anywhere (the capacity equals the bytes live in every section, as when the optimum
meets the lower bound), a node never wastes and the branching above is exhaustive: a search that
runs out of branches proves the part cannot fit (``INFEASIBLE``). With slack, giving up a whole run
is only one of the ways waste can fall, so an exhausted search proves nothing (``EXHAUSTED``): the
search then serves as a constructive heuristic, and ``pack_search``'s branch-and-bound does the
proving.

The work is counted (sections and buffers touched) against a budget, as in ``pack_search``, so a
budget always ends at the same node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack_search import BUDGET, FOUND, INFEASIBLE

# How the buffers starting at a point are tried, in the order the solver cycles through them.
ORDERS = ("largest", "longest", "area", "shortest")
EXHAUSTED = "exhausted"  # no packing found, but the search was not exhaustive: no proof
# Work is counted in Python statements (a node costs about 40, besides its scans; C-level scans
# such as min, index and slices cost about 1/16 of one per element), then reported in
# pack_search's units: one statement here is about 12 of its array elements (measured: 7-10 M
# statements per CPU second against pack_search's 100 M elements).
_NODE_WORK = 40
_SCAN_DIVISOR = 16
_UNIT = 12


@dataclass
class SkylineOutcome:
    status: str  # FOUND, INFEASIBLE (proven), EXHAUSTED (not proven) or BUDGET
    offsets: np.ndarray | None  # local offsets of the part's buffers when FOUND
    work: int


def fill(
    lo: np.ndarray,
    hi: np.ndarray,
    size: np.ndarray,
    align: np.ndarray,
    n_sections: int,
    capacity: int,
    budget: int,
    order: str = "longest",
) -> SkylineOutcome:
    """Search for offsets of buffers live in sections ``[lo, hi)`` within ``capacity`` bytes.

    ``order`` picks how the buffers starting at a point are tried (``ORDERS``).
    """
    m, k = int(size.size), int(n_sections)
    if m == 0:
        return SkylineOutcome(FOUND, np.zeros(0, dtype=np.int64), 0)
    delta = np.zeros(k + 1, dtype=np.int64)
    np.add.at(delta, lo, size)
    np.add.at(delta, hi, -size)
    live = np.cumsum(delta)[:k]
    if int(live.max()) > capacity or int(size.max()) > capacity:
        return SkylineOutcome(INFEASIBLE, None, k)
    run = _Fill(lo, hi, size, align, live, capacity, budget // _UNIT, order)
    status = run.search()
    if status == INFEASIBLE and run.had_slack:
        status = EXHAUSTED
    offsets = np.asarray(run.offset, dtype=np.int64) if status == FOUND else None
    return SkylineOutcome(status, offsets, run.work * _UNIT)


class _Fill:
    def __init__(self, lo, hi, size, align, live, capacity, budget, order):
        self.lo, self.hi = lo.tolist(), hi.tolist()
        self.size, self.align = size.tolist(), align.tolist()
        self.capacity, self.budget = int(capacity), int(budget)
        self.k = len(live)
        self.done = int(capacity) + 1  # height of a section with nothing left to place
        self.rem = live.tolist()  # bytes still to place, per section
        self.height = [0 if r > 0 else self.done for r in self.rem]
        self.slack = [self.capacity - r for r in self.rem]
        self.had_slack = any(s > 0 for s, r in zip(self.slack, self.rem, strict=True) if r > 0)
        # Unplaced bytes starting, and ending, at each section boundary (for the step check).
        self.starting = [0] * (self.k + 1)
        self.ending = [0] * (self.k + 1)
        for a, z, b in zip(self.lo, self.hi, self.size, strict=True):
            self.starting[a] += b
            self.ending[z] += b
        self.offset = [0] * len(self.size)
        self.top_buf = [-1] * self.k  # the buffer placed last in each section
        self.saved_top: list[list[int]] = []  # top_buf before each placement on the path
        self.left = sum(1 for z in self.size if z > 0)
        self.placed = [z == 0 for z in self.size]  # empty buffers occupy nothing
        # Buffers by starting section, in the order tried (ties by index: deterministic).
        idx, length = np.arange(size.size), hi - lo
        key = {
            "longest": (idx, -size, -length),
            "largest": (idx, -length, -size),
            "shortest": (idx, -size, length),
            "area": (idx, -(size * length)),
        }[order]
        self.by_start: list[list[int]] = [[] for _ in range(self.k)]
        for b in np.lexsort(key).tolist():
            if size[b] > 0:
                self.by_start[self.lo[b]].append(b)
        self.work = 0

    def search(self) -> str:
        """Depth-first over an explicit stack of nodes; each node is (choices, next choice)."""
        stack: list[list] = []
        node = self._expand()
        while True:
            if node is None:  # every buffer placed
                return FOUND
            choices, i = node
            if i > 0:
                self._undo(choices[i - 1])
            if i == len(choices):
                if not stack:
                    return INFEASIBLE
                node = stack.pop()
                continue
            node[1] = i + 1
            if self.work > self.budget:
                return BUDGET
            if not self._apply(choices[i]):
                continue  # undone at the top of the loop, then the next choice
            stack.append(node)
            node = self._expand()

    def _expand(self) -> list | None:
        """The branches at the lowest point, or None when nothing is left to place."""
        if self.left == 0:
            return None
        height = self.height
        y = min(height)
        t0 = height.index(y)
        t1 = t0 + 1
        k = self.k
        while t1 < k and height[t1] == y:
            t1 += 1
        self.work += _NODE_WORK + (k + t1 - t0) // _SCAN_DIVISOR
        choices: list[tuple] = []
        seen = set()
        hi, size, align, placed = self.hi, self.size, self.align, self.placed
        under = self.top_buf[t0]
        if under >= 0 and (self.offset[under] + size[under] != y or self.lo[under] != t0):
            under = -1  # nothing rests at y on a buffer starting here
        for b in self.by_start[t0]:
            if placed[b] or hi[b] > t1 or y % align[b]:
                continue
            if under >= 0 and hi[under] == hi[b] and size[under] < size[b]:
                continue  # twins (same sections) touching: the larger one goes below
            twin = (hi[b], size[b], align[b])
            if twin in seen:
                continue  # an identical buffer is tried already
            seen.add(twin)
            choices.append(("place", b, y))
        self.work += len(self.by_start[t0])
        # Give the run up: raise it to its lower neighbour (sections done are no neighbours).
        left = height[t0 - 1] if t0 > 0 else self.done
        right = height[t1] if t1 < k else self.done
        target = min(left, right)
        if target < self.done:
            d = target - y
            slack = self.slack
            if min(slack[t0:t1]) >= d:
                choices.append(("waste", t0, t1, y, d))
        # Exact fits first: a buffer that closes the run leaves no sliver to fill.
        choices.sort(key=lambda c: c[0] != "place" or hi[c[1]] != t1)
        return [choices, 0]

    def _apply(self, choice: tuple) -> bool:
        """Make the move; False when a step it leaves can no longer be filled (see _step_ok)."""
        if choice[0] == "place":
            _, b, y = choice
            top = y + self.size[b]
            self.offset[b] = y
            self.placed[b] = True
            self.left -= 1
            a, z = self.lo[b], self.hi[b]
            rem, height = self.rem, self.height
            for s in range(a, z):
                rem[s] -= self.size[b]
                height[s] = top if rem[s] else self.done
            self.starting[a] -= self.size[b]
            self.ending[z] -= self.size[b]
            self.saved_top.append(self.top_buf[a:z])
            self.top_buf[a:z] = [b] * (z - a)
            self.work += (z - a) * 2
            return self._step_ok(a) and self._step_ok(z)
        _, t0, t1, y, d = choice
        for s in range(t0, t1):
            self.height[s] = y + d
            self.slack[s] -= d
        self.work += (t1 - t0) * 2
        return self._step_ok(t0) and self._step_ok(t1)

    def _step_ok(self, s: int) -> bool:
        """Whether the skyline's step at boundary ``s`` (between sections s-1 and s) can be filled.

        Where the skyline drops from section s-1 to s, the bytes of column s between the two
        heights cannot be covered by a buffer that is also live in s-1 (taken there): they are
        covered by buffers starting at s or wasted, so those buffers and s's slack must reach the
        drop. A rise is the mirror image: buffers ending at s and s-1's slack. A section with
        nothing left counts as full.
        """
        if s <= 0 or s >= self.k:
            return True
        left, right = self.height[s - 1], self.height[s]
        if left == right:
            return True
        if left >= self.done:
            left = self.capacity
        if right >= self.done:
            right = self.capacity
        if left > right:
            return self.starting[s] + self.slack[s] >= left - right
        return self.ending[s] + self.slack[s - 1] >= right - left

    def _undo(self, choice: tuple) -> None:
        if choice[0] == "place":
            _, b, y = choice
            self.placed[b] = False
            self.left += 1
            self.starting[self.lo[b]] += self.size[b]
            self.ending[self.hi[b]] += self.size[b]
            self.top_buf[self.lo[b] : self.hi[b]] = self.saved_top.pop()
            rem, height = self.rem, self.height
            for s in range(self.lo[b], self.hi[b]):
                rem[s] += self.size[b]
                height[s] = y
        else:
            _, t0, t1, y, d = choice
            for s in range(t0, t1):
                self.height[s] = y
                self.slack[s] += d
