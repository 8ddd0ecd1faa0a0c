"""The offset packer: greedy first, then exact search for a smaller arena within a budget.

``solve(problem, seconds)``:

1. greedy best-fit over several orders (``pack_greedy``); an arena equal to the live-bytes lower
   bound is optimal and ends it (every checked-in LLM plan stops here);
2. otherwise the problem is split into independent parts (no buffer crosses between them) and a
   search over capacities ``C`` runs, lowest first: every part whose greedy packing is above ``C``
   is searched (``pack_search``) for a packing within ``C``. A part found to fit lowers the arena;
   a part proven not to fit raises the proven lower bound to the next possible arena above ``C``.
   Capacities are probed from the lower bound up, then halving the remaining gap, until the arena
   meets the proven bound (optimal) or the budget is spent (the gap is reported).

``seconds`` is turned into a fixed amount of search work (``WORK_PER_SECOND``, measured on the
development machine), so the same problem and budget always give the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack_greedy import best_fit, greedy_orders
from dctms.toolkit.pack_problem import Problem, Sweep, granule, live_max, sweep
from dctms.toolkit.pack_search import BUDGET, FOUND, INFEASIBLE, Outcome, PartSearch, preorders

# Search work (array elements touched, see pack_search) per second of budget on one core here.
WORK_PER_SECOND = 80_000_000
# The first node limit of the round-robin over pre-orders, per buffer of the part (then doubled).
_FIRST_LIMIT_NODES = 4


@dataclass(frozen=True)
class Packing:
    offsets: list[int]
    arena: int
    lower_bound: int  # most bytes live at once: no arena is smaller
    bound: int  # proven lower bound on the optimal arena (>= lower_bound, <= arena)
    greedy_arena: int  # the best greedy order's arena (before any search)
    work: int = 0  # search work spent

    @property
    def proven_optimal(self) -> bool:
        return self.arena == self.bound

    @property
    def gap(self) -> int:
        """Bytes the arena may be above the optimum (0 when proven optimal)."""
        return self.arena - self.bound

    @property
    def proof(self) -> str | None:
        """What proves the arena minimal: "lower_bound", "search", or None (not proven)."""
        if self.arena == self.lower_bound:
            return "lower_bound"
        return "search" if self.arena == self.bound else None


def solve(p: Problem, seconds: float = 0.0) -> Packing:
    """Offsets for every buffer of ``p``; see the module docstring."""
    lower = live_max(p)
    if p.n == 0:
        return Packing([], 0, 0, 0, 0)
    sw = sweep(p)
    best_offsets, best_arena = None, None
    for order in greedy_orders(p):
        offsets, arena = best_fit(p, sw, order)
        if best_arena is None or arena < best_arena:
            best_offsets, best_arena = offsets, arena
        if arena <= lower:
            break
    greedy_arena = best_arena
    budget = int(seconds * WORK_PER_SECOND)
    if best_arena <= lower or budget <= 0:
        return Packing(best_offsets.tolist(), best_arena, lower, lower, greedy_arena)
    offsets, arena, bound, work = _search(p, sw, best_offsets, lower, budget)
    return Packing(offsets.tolist(), arena, lower, bound, greedy_arena, work)


def _search(
    p: Problem, sw: Sweep, offsets: np.ndarray, lower: int, budget: int
) -> tuple[np.ndarray, int, int, int]:
    offsets = offsets.copy()
    g = granule(p)
    parts = []
    for members, first, last in sw.parts:
        members = members[p.size[members] > 0]  # empty buffers occupy nothing: offset as is
        if members.size:
            parts.append([members, first, last, None])  # last slot: the PartSearch, made lazily
    tops = [int((offsets[m] + p.size[m]).max()) for m, *_ in parts]
    infeasible_at = [-1] * len(parts)  # the highest capacity proven too small, per part
    arena = max(tops, default=0)
    bound, probe_floor, spent = lower, lower, 0
    while probe_floor < arena and spent < budget:
        capacity = bound if probe_floor == bound else _mid(probe_floor, arena, g)
        share = (budget - spent) // 2 if capacity == lower else budget - spent
        status, used = _probe(p, sw, parts, offsets, tops, infeasible_at, capacity, share)
        spent += used
        arena = max(tops, default=0)
        if status == INFEASIBLE:
            bound = max(bound, _next_multiple(capacity, g))
            probe_floor = max(probe_floor, bound)
        elif status == BUDGET:
            probe_floor = _next_multiple(capacity, g)
    return offsets, arena, bound, spent


def _probe(
    p, sw, parts, offsets, tops, infeasible_at, capacity: int, budget: int
) -> tuple[str, int]:
    """Fit every part above ``capacity`` into it; FOUND only if all fit."""
    spent = 0
    status = FOUND
    above = sorted((i for i in range(len(parts)) if tops[i] > capacity), key=lambda i: -tops[i])
    for i in above:
        if infeasible_at[i] >= capacity:
            return INFEASIBLE, spent
        members, first, last, search = parts[i]
        if search is None:
            search = PartSearch(p, sw, members, first, last)
            parts[i][3] = search
        outcome, used = _round_robin(search, capacity, budget - spent)
        spent += used
        if outcome.status == FOUND:
            offsets[members] = outcome.offsets
            tops[i] = int((outcome.offsets + search.size).max())
        elif outcome.status == INFEASIBLE:
            infeasible_at[i] = capacity
            return INFEASIBLE, spent
        else:
            status = BUDGET
            if spent >= budget:
                return BUDGET, spent
    return status, spent


def _round_robin(search: PartSearch, capacity: int, budget: int) -> tuple[Outcome, int]:
    """Each pre-order in turn with a node limit that doubles (MiniMalloc's restarts)."""
    setup = search.overlap_cost()
    if setup > budget:
        return Outcome(BUDGET, None, 0), 0
    spent = setup
    search.overlaps()
    length = (search.hi - search.lo).astype(np.int64)
    ranks = preorders(search.size, length, search.crowding())
    limit = _FIRST_LIMIT_NODES * search.m * (search.m + search.k)
    while True:
        for rank in ranks:
            left = budget - spent
            if left <= 0:
                return Outcome(BUDGET, None, spent), spent
            outcome = search.fits(capacity, rank, min(limit, left))
            spent += outcome.work
            if outcome.status != BUDGET:
                return outcome, spent
        limit *= 2


def _next_multiple(value: int, g: int) -> int:
    """The smallest multiple of ``g`` above ``value``."""
    return (value // g + 1) * g


def _mid(low: int, high: int, g: int) -> int:
    steps = (high - low) // g
    return low + max(steps // 2, 0) * g
