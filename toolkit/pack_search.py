"""Exact search: does a part of a packing problem fit in ``capacity`` bytes? (branch and bound)

The search is in the spirit of MiniMalloc (Moffitt, ASPLOS 2023). Some optimal packing is
*canonical*: every buffer sits on the floor or directly on a buffer it overlaps in time, and
placing buffers in order of offset (ties by a fixed pre-order) rebuilds it, each at the lowest
offset the already placed buffers leave it (its ``min_off``). So a node only branches on unplaced
buffers taken in that order, at their ``min_off``; it prunes

* non-canonical children: offset (then pre-order rank) below the last placed buffer's;
* dominated children: an offset at or above some unplaced buffer's ``min_off + size`` would leave
  a hole that buffer could drop into, so a canonical packing never does it;
* infeasible nodes: in each *section* (a time range with a fixed live set) the buffers still to
  place all stack above the last one placed there (placement is in offset order), so their total
  must fit between that floor and the capacity.

The search counts its *work* (array elements touched) against a budget instead of reading a
clock, so a given budget always ends at the same node: the packing is deterministic whatever the
machine's load.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack_problem import Problem, Sweep

FOUND, INFEASIBLE, BUDGET = "found", "infeasible", "budget"
_NODE_OVERHEAD = 3000  # the fixed cost of a node (Python and numpy calls) in array elements


@dataclass
class Outcome:
    status: str  # FOUND, INFEASIBLE (proven: no packing fits) or BUDGET (gave up)
    offsets: np.ndarray | None  # local offsets of the part's members when FOUND
    work: int


def preorders(size: np.ndarray, length: np.ndarray, total: np.ndarray) -> list[np.ndarray]:
    """Pre-orders tried in turn (rank per buffer): by crowdedness, by size, by area."""
    idx = np.arange(size.size)
    keys = [
        np.lexsort((idx, -size, -length, -total)),
        np.lexsort((idx, -length, -size)),
        np.lexsort((idx, -size, -(size * length))),
    ]
    ranks = []
    for order in keys:
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        ranks.append(rank)
    return ranks


class PartSearch:
    """The search state of one part (buffers ``members``, sections ``first .. last``)."""

    def __init__(self, p: Problem, sw: Sweep, members: np.ndarray, first: int, last: int):
        self.size = p.size[members]
        self.align = p.align[members]
        self.lo = (sw.sec_lo[members] - first).astype(np.int64)
        self.hi = (sw.sec_hi[members] - first).astype(np.int64)
        self.m = int(members.size)
        self.k = int(last - first)
        delta = np.zeros(self.k + 1, dtype=np.int64)
        np.add.at(delta, self.lo, self.size)
        np.add.at(delta, self.hi, -self.size)
        self.total0 = np.cumsum(delta)[: self.k]
        self._overlaps: list[np.ndarray] | None = None
        # Section -> live buffers as one flat array, each section led by the sentinel m (whose
        # min_off is "infinite"), so a per-section minimum is one reduceat and never empty.
        length = self.hi - self.lo
        owner = np.repeat(np.arange(self.m), length)
        starts = np.repeat(np.cumsum(length) - length, length)
        section = np.repeat(self.lo, length) + (np.arange(owner.size) - starts)
        section = np.concatenate((np.arange(self.k), section))
        owner = np.concatenate((np.full(self.k, self.m), owner))
        order = np.argsort(section, kind="stable")
        self.sec_members = owner[order]
        self.sec_start = np.searchsorted(section[order], np.arange(self.k + 1))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Per buffer, the sections of it and of every buffer it overlaps (one range)."""
        overlaps = self.overlaps()
        span_lo = np.array(
            [min(self.lo[b], self.lo[o].min(initial=self.lo[b])) for b, o in enumerate(overlaps)],
            dtype=np.int64,
        )
        span_hi = np.array(
            [max(self.hi[b], self.hi[o].max(initial=self.hi[b])) for b, o in enumerate(overlaps)],
            dtype=np.int64,
        )
        return span_lo, span_hi

    def overlap_cost(self) -> int:
        """Work of listing, for each buffer, the buffers it overlaps (the prefix scans below)."""
        order = np.argsort(self.lo, kind="stable")
        prefix = np.searchsorted(self.lo[order], self.hi, side="left")
        return int(prefix.sum())

    def overlaps(self) -> list[np.ndarray]:
        if self._overlaps is None:
            order = np.argsort(self.lo, kind="stable")
            lo_sorted = self.lo[order]
            hi_sorted = self.hi[order]
            out = []
            for b in range(self.m):
                k = int(np.searchsorted(lo_sorted, self.hi[b], side="left"))
                near = order[:k][hi_sorted[:k] > self.lo[b]]
                out.append(near[near != b])
            self._overlaps = out
        return self._overlaps

    def crowding(self) -> np.ndarray:
        """Per buffer: the most bytes live in any of its sections."""
        return np.array(
            [
                self.total0[a:b].max()
                for a, b in zip(self.lo.tolist(), self.hi.tolist(), strict=True)
            ],
            dtype=np.int64,
        )

    def fits(self, capacity: int, rank: np.ndarray, budget: int) -> Outcome:
        """Depth-first search for a packing of this part within ``capacity``."""
        if self.m == 0:
            return Outcome(FOUND, np.zeros(0, dtype=np.int64), 0)
        if int(self.total0.max()) > capacity or int(self.size.max()) > capacity:
            return Outcome(INFEASIBLE, None, self.k)
        run = _Run(self, capacity, rank, budget)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * self.m + 1000))
        try:
            found = run.solve(np.arange(self.m), -1, -1)
        except _OutOfBudget:
            return Outcome(BUDGET, None, run.work)
        finally:
            sys.setrecursionlimit(limit)
        return Outcome(FOUND if found else INFEASIBLE, run.offset.copy() if found else None, run.work)


class _OutOfBudget(Exception):
    pass


class _Run:
    """One depth-first search; placements are undone from a trail on backtracking.

    After each placement the unplaced buffers are split into groups that overlap no other group in
    time (MiniMalloc's dynamic decomposition): the groups cannot interact any more, so each is
    solved on its own and the first group that fails fails the node, instead of the search
    retrying every interleaving of the other groups' placements.
    """

    def __init__(self, ps: PartSearch, capacity: int, rank: np.ndarray, budget: int):
        m, k = ps.m, ps.k
        self.ps, self.capacity, self.rank, self.budget = ps, capacity, rank, budget
        self.overlaps = ps.overlaps()
        self.span_lo, self.span_hi = ps.spans()
        self.never = np.iinfo(np.int64).max // 4
        # Lowest offset each unplaced buffer can take; ``never`` once placed and for the sentinel m.
        self.min_off = np.zeros(m + 1, dtype=np.int64)
        self.min_off[m] = self.never
        self.offset = np.zeros(m, dtype=np.int64)
        self.floor = np.zeros(k, dtype=np.int64)  # top of the buffer placed last in each section
        self.rest_floor = np.zeros(k, dtype=np.int64)  # lowest min_off of the unplaced there
        self.total = ps.total0.copy()  # bytes of the unplaced buffers live in each section
        self.trail: list[tuple] = []
        self.work = 0

    def solve(self, group: np.ndarray, last_off: int, last_rank: int) -> bool:
        """Place every buffer of ``group`` (all unplaced, connected in time) within capacity."""
        ps, min_off, rank = self.ps, self.min_off, self.rank
        if group.size == 0:
            return True
        mo = min_off[group]
        tops = mo + ps.size[group]
        if int(tops.max()) > self.capacity:
            return False  # min_off only grows: that buffer can never fit
        min_height = tops.min()
        rk = rank[group]
        ok = (mo < min_height) & ((mo > last_off) | ((mo == last_off) & (rk > last_rank)))
        cand = group[ok]
        cand = cand[np.lexsort((rank[cand], min_off[cand]))].tolist()
        sec_a, sec_z = int(ps.lo[group].min()), int(ps.hi[group].max())
        mark = len(self.trail)
        for b in cand:
            if self.work > self.budget:
                raise _OutOfBudget
            o = int(min_off[b])
            self._place(b, o)
            if not self._dead(o, sec_a, sec_z):
                rest = group[group != b]
                groups = _split(rest, ps.lo, ps.hi)
                if all(self.solve(g, o, int(rank[b])) for g in groups):
                    return True
            self._undo_to(mark)
        return False

    def _place(self, b: int, o: int) -> None:
        ps, min_off = self.ps, self.min_off
        top = o + int(ps.size[b])
        self.offset[b] = o
        saved_b = int(min_off[b])
        min_off[b] = self.never
        ov = self.overlaps[b]
        saved_mo = min_off[ov]
        align = ps.align[ov]
        min_off[ov] = np.maximum(saved_mo, -(-top // align) * align)
        a, z = int(ps.lo[b]), int(ps.hi[b])
        saved_floor = self.floor[a:z].copy()
        self.floor[a:z] = top
        self.total[a:z] -= ps.size[b]
        # Sections whose unplaced set or min_offs changed: those of b and of its overlaps.
        sa, sz = int(self.span_lo[b]), int(self.span_hi[b])
        e0, e1 = int(ps.sec_start[sa]), int(ps.sec_start[sz])
        saved_rest = self.rest_floor[sa:sz].copy()
        self.rest_floor[sa:sz] = np.minimum.reduceat(
            min_off[ps.sec_members[e0:e1]], ps.sec_start[sa:sz] - e0
        )
        self.trail.append((b, saved_b, ov, saved_mo, saved_floor, saved_rest))
        self.work += ps.m + ps.k + (e1 - e0) + _NODE_OVERHEAD

    def _undo_to(self, mark: int) -> None:
        ps = self.ps
        while len(self.trail) > mark:
            b, saved_b, ov, saved_mo, saved_floor, saved_rest = self.trail.pop()
            self.min_off[ov] = saved_mo
            self.min_off[b] = saved_b
            a, z = int(ps.lo[b]), int(ps.hi[b])
            self.floor[a:z] = saved_floor
            self.total[a:z] += ps.size[b]
            self.rest_floor[int(self.span_lo[b]) : int(self.span_hi[b])] = saved_rest

    def _dead(self, o: int, a: int, z: int) -> bool:
        # In each section of the group, the buffers still to place stack above max(floor, the
        # last offset, the lowest min_off among them): their total must fit below the capacity.
        total = self.total[a:z]
        need = np.maximum(np.maximum(self.floor[a:z], o), self.rest_floor[a:z]) + total
        return bool(((need > self.capacity) & (total > 0)).any())


def _split(group: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[np.ndarray]:
    """``group`` cut into runs of buffers connected by overlapping time (sections)."""
    if group.size <= 1:
        return [group]
    order = np.argsort(lo[group], kind="stable")
    g = group[order]
    reach = np.maximum.accumulate(hi[g])
    cuts = np.flatnonzero(lo[g][1:] >= reach[:-1]) + 1
    if cuts.size == 0:
        return [group]
    return np.split(g, cuts)
