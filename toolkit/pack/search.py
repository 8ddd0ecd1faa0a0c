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
  place stack above the highest of: the top of the last one placed there (placement is in offset
  order), the last placed offset, and the lowest offset any of them can still take (its
  ``min_off``, or just above the last placed offset once canonical order rules that out); their
  total must fit between that and the capacity;
* twin stacks: buffers with identical sections that touch stack in one fixed order (``_Run``).

After each placement the unplaced buffers of a group split into groups that overlap no other in
time (dynamic decomposition); each is solved on its own.

The search counts its *work* (array elements touched) against a budget instead of reading a
clock, so a given budget always ends at the same node: the packing is deterministic whatever the
machine's load.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack.problem import Problem, Sweep

FOUND, INFEASIBLE, BUDGET = "found", "infeasible", "budget"
_NODE_OVERHEAD = 3000  # the fixed cost of a node (Python and numpy calls) in array elements


@dataclass
class Outcome:
    status: str  # FOUND, INFEASIBLE (proven: no packing fits) or BUDGET (gave up)
    offsets: np.ndarray | None  # local offsets of the part's members when FOUND
    work: int


def preorders(
    start: np.ndarray, size: np.ndarray, length: np.ndarray, total: np.ndarray
) -> list[np.ndarray]:
    """Pre-orders tried in turn (rank per buffer). With offsets first, ranking by start gives the
    bottom-left (skyline) order: the next buffer covers the lowest, leftmost free point; taller
    or larger buffers first among those starting together. Then MiniMalloc's crowdedness order."""
    idx = np.arange(size.size)
    keys = [
        np.lexsort((idx, -size, start)),
        np.lexsort((idx, -(size * length), start)),
        np.lexsort((idx, -size, -length, -total)),
        np.lexsort((idx, -length, start)),
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
        self._ranks: list[np.ndarray] | None = None
        self._spans: tuple[np.ndarray, np.ndarray] | None = None
        # Twins: buffers live in exactly the same sections; twin_key orders a stack of them.
        self.twin_key = np.empty(self.m, dtype=np.int64)
        self.twin_key[np.lexsort((np.arange(self.m), -self.size))] = np.arange(self.m)
        by_range = np.lexsort((self.hi, self.lo))
        self.twins = [np.zeros(0, dtype=np.int64)] * self.m
        same = (np.diff(self.lo[by_range]) != 0) | (np.diff(self.hi[by_range]) != 0)
        for run in np.split(by_range, np.flatnonzero(same) + 1):
            if run.size > 1:
                for b in run.tolist():
                    self.twins[b] = run[run != b]
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
        if self._spans is not None:
            return self._spans
        overlaps = self.overlaps()
        span_lo = np.array(
            [min(self.lo[b], self.lo[o].min(initial=self.lo[b])) for b, o in enumerate(overlaps)],
            dtype=np.int64,
        )
        span_hi = np.array(
            [max(self.hi[b], self.hi[o].max(initial=self.hi[b])) for b, o in enumerate(overlaps)],
            dtype=np.int64,
        )
        self._spans = (span_lo, span_hi)
        return self._spans

    def ranks(self) -> list[np.ndarray]:
        """The pre-orders to try (computed once)."""
        if self._ranks is None:
            length = (self.hi - self.lo).astype(np.int64)
            self._ranks = preorders(self.lo, self.size, length, self.crowding())
        return self._ranks

    def dive_extra(self) -> int:
        """The section work of placing every buffer once (each revisits its overlaps' sections)."""
        span_lo, span_hi = self.spans()
        return int((self.sec_start[span_hi] - self.sec_start[span_lo]).sum()) // 8

    def node_work(self) -> int:
        """The work of a node, besides the sections it revisits."""
        return self.m + self.k + _NODE_OVERHEAD

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
        return Outcome(
            FOUND if found else INFEASIBLE, run.offset.copy() if found else None, run.work
        )


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
        # A lower bound on each unplaced buffer's final offset for the section inference: its
        # min_off, or just above the last placed offset once canonical order rules min_off out.
        self.bound = self.min_off.copy()
        self.blocked_at = np.full(m + 1, -1, dtype=np.int64)  # see _place: twins
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
        # A buffer blocked by its twin cannot take its min_off, so it cannot drop there either.
        free = self.blocked_at[group] != mo
        if not free.any():
            return False
        min_height = tops[free].min()
        rk = rank[group]
        ok = free & (mo < min_height) & ((mo > last_off) | ((mo == last_off) & (rk > last_rank)))
        cand = group[ok]
        cand = cand[np.lexsort((rank[cand], min_off[cand]))].tolist()
        sec_a, sec_z = int(ps.lo[group].min()), int(ps.hi[group].max())
        mark = len(self.trail)
        for b in cand:
            if self.work > self.budget:
                raise _OutOfBudget
            o = int(min_off[b])
            if self._twin_below(b, o):
                continue
            rest = group[group != b]
            self._place(b, o, rest)
            if not self._dead(o, sec_a, sec_z):
                # A plain loop, not all(<generator>): on Python 3.12 a call through a C function
                # counts against the interpreter's fixed C recursion limit, which one level per
                # buffer placed overflows (3.11 counted Python frames only).
                for g in _split(rest, ps.lo, ps.hi):
                    if not self.solve(g, o, int(rank[b])):
                        break
                else:
                    return True
            self._undo_to(mark)
        return False

    def _twin_below(self, b: int, o: int) -> bool:
        """Whether b would rest directly on a placed twin (same sections) that must be above it.

        Twins stacked directly on each other can swap places: the bytes they cover together stay
        the same, so every buffer still rests on something and none could drop lower (what the
        canonical form and the dominance rule rely on). So some optimal packing stacks touching
        twins in ``twin_key`` order: larger ones lower, as the bottom-left pre-orders try first.
        """
        twins = self.ps.twins[b]
        if twins.size == 0:
            return False
        placed = twins[self.min_off[twins] == self.never]
        if placed.size == 0:
            return False
        below = placed[self.offset[placed] + self.ps.size[placed] == o]
        return bool((self.ps.twin_key[below] > self.ps.twin_key[b]).any())

    def _place(self, b: int, o: int, rest: np.ndarray) -> None:
        ps, min_off, bound = self.ps, self.min_off, self.bound
        top = o + int(ps.size[b])
        self.offset[b] = o
        saved_b = (int(min_off[b]), int(bound[b]))
        min_off[b] = bound[b] = self.never
        ov = self.overlaps[b]
        saved_mo, saved_bound = min_off[ov], bound[ov]
        align = ps.align[ov]
        min_off[ov] = np.maximum(saved_mo, -(-top // align) * align)
        bound[ov] = np.maximum(saved_bound, min_off[ov])
        # Canonical order rules out offset o for the unplaced buffers that would come before b
        # (lower min_off, or o with a lower rank): they end strictly above o.
        rank = self.rank
        mo = min_off[rest]
        stuck = rest[(mo < o) | ((mo == o) & (rank[rest] < rank[b]))]
        if stuck.size:
            lifted = o + ps.align[stuck]
            stuck = stuck[bound[stuck] < lifted]
        saved_stuck = bound[stuck]
        if stuck.size:
            bound[stuck] = o + ps.align[stuck]
        # Twins after b in twin_key order whose min_off is now b's top would rest on b: ruled out.
        twins = ps.twins[b]
        blocked = twins[(min_off[twins] == top) & (ps.twin_key[twins] < ps.twin_key[b])]
        saved_blocked = (self.blocked_at[blocked], bound[blocked])
        if blocked.size:
            self.blocked_at[blocked] = top
            bound[blocked] = np.maximum(bound[blocked], top + ps.align[blocked])
        a, z = int(ps.lo[b]), int(ps.hi[b])
        saved_floor = self.floor[a:z].copy()
        self.floor[a:z] = top
        self.total[a:z] -= ps.size[b]
        # Sections whose unplaced set or bounds changed: those of b, its overlaps and the stuck.
        sa, sz = int(self.span_lo[b]), int(self.span_hi[b])
        if stuck.size:
            sa, sz = min(sa, int(ps.lo[stuck].min())), max(sz, int(ps.hi[stuck].max()))
        e0, e1 = int(ps.sec_start[sa]), int(ps.sec_start[sz])
        saved_rest = self.rest_floor[sa:sz].copy()
        self.rest_floor[sa:sz] = np.minimum.reduceat(
            bound[ps.sec_members[e0:e1]], ps.sec_start[sa:sz] - e0
        )
        self.trail.append(
            (
                b,
                saved_b,
                ov,
                saved_mo,
                saved_bound,
                stuck,
                saved_stuck,
                saved_floor,
                sa,
                saved_rest,
                blocked,
                saved_blocked,
            )
        )
        self.work += ps.m + ps.k + (e1 - e0) // 8 + _NODE_OVERHEAD  # reduceat runs ~8x faster

    def _undo_to(self, mark: int) -> None:
        ps, min_off, bound = self.ps, self.min_off, self.bound
        while len(self.trail) > mark:
            (
                b,
                saved_b,
                ov,
                saved_mo,
                saved_bound,
                stuck,
                saved_stuck,
                saved_floor,
                sa,
                saved_rest,
                blocked,
                saved_blocked,
            ) = self.trail.pop()
            self.blocked_at[blocked], bound[blocked] = saved_blocked
            bound[stuck] = saved_stuck
            min_off[ov] = saved_mo
            bound[ov] = saved_bound
            min_off[b], bound[b] = saved_b
            a, z = int(ps.lo[b]), int(ps.hi[b])
            self.floor[a:z] = saved_floor
            self.total[a:z] += ps.size[b]
            self.rest_floor[sa : sa + saved_rest.size] = saved_rest

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
