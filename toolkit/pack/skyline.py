"""Skyline search: fill a part of a packing problem bottom-left, one valley at a time.

Time is cut into sections (``problem.Sweep``); the *skyline* is, per section, the height below
which every byte is taken (by a placed buffer) or given up (waste). A *valley* is a flat run of
sections ``[t0, t1)`` at height ``y`` whose neighbours are both higher (or the part ends there). A
buffer covering the valley's left end cannot reach into the higher section before it nor below
``y``, so it *starts* at ``t0``, sits at offset ``y`` and ends by ``t1``. A node branches on those
buffers (few: usually one to three), then on giving the valley up as waste, raised to its lower
neighbour; it picks the valley with the fewest branches (fail first: a valley nothing can fill ends
the node at once). Pruning: per section, the bytes still to place plus the height must stay within
the capacity (a placement keeps that sum, only waste spends the section's *slack*: capacity minus
the bytes live there); where the skyline steps down (up), the buffers starting (ending) at that
boundary plus the slack must reach the step (``_step_ok``); identical buffers are tried once per
node; touching twins (same sections) stack larger below, which some optimal packing does.

With no slack anywhere (the capacity equals the bytes live in every section, as when the optimum
meets the lower bound), a node never wastes and the branching above is exhaustive: a search that
runs out of branches proves the part cannot fit (``INFEASIBLE``). With slack, giving up a whole
valley is only one of the ways waste can fall, so an exhausted search proves nothing
(``EXHAUSTED``): the search then serves as a constructive heuristic, and ``search``'s
branch-and-bound does the proving.

The work is counted (Python statements, reported in ``search``'s units) against a budget, so a
budget always ends at the same node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack.search import BUDGET, FOUND, INFEASIBLE

# How the buffers starting at a point are tried, in the order the solver cycles through them.
ORDERS = ("largest", "area")
EXHAUSTED = "exhausted"  # no packing found, but the search was not exhaustive: no proof
# Work is counted in Python statements (a node costs about 40, besides its scans; C-level scans
# such as min, index and slices cost about 1/16 of one per element), then reported in
# search.py's units: one statement here is about 12 of its array elements (measured: 7-10 M
# statements per CPU second against search.py's 100 M elements).
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
    order: str = "largest",
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
            "largest": (idx, -length, -size),
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
        """The branches at the valley with the fewest, or None when nothing is left to place.

        Any *valley* (a flat run whose neighbours are both higher) has the property the lowest
        point has: a buffer covering its left end starts there, at its height, and ends within
        it. So the search may branch on any valley; it takes the one with the fewest branches
        (fail first: a valley no buffer can fill ends the node at once), the lowest then the
        leftmost among equals.
        """
        if self.left == 0:
            return None
        height, k, done = self.height, self.k, self.done
        best: list[tuple] | None = None
        best_y = done
        t0 = 0
        self.work += _NODE_WORK + k // 3  # the run scan: a few bytecodes per section
        while t0 < k:
            y = height[t0]
            t1 = t0 + 1
            while t1 < k and height[t1] == y:
                t1 += 1
            if y < done and (t0 == 0 or height[t0 - 1] > y) and (t1 == k or height[t1] > y):
                choices = self._choices(t0, t1, y)
                if best is None or (len(choices), y) < (len(best), best_y):
                    best, best_y = choices, y
                    if len(best) <= 1:
                        break  # forced (or dead): nothing fewer to find
            t0 = t1
        return [best, 0]

    def _choices(self, t0: int, t1: int, y: int) -> list[tuple]:
        """Buffers that can cover the valley ``[t0, t1)`` at height ``y``, then giving it up."""
        height, k = self.height, self.k
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
        return choices

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
