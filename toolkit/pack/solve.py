"""The offset packer: greedy first, then exact search for a smaller arena within a budget.

``solve(problem, seconds)``:

1. greedy best-fit over several orders (``greedy``); an arena equal to the live-bytes lower
   bound is optimal and ends it (the checked-in 7B plan's phases stop here). Its work is capped
   (``greedy_budget``: quadratic with thousands of buffers live at once); when not even the first
   order fits under the cap, the online allocator (``online``) gives the starting packing;
2. otherwise the buffers are glued into blocks (``coarsen``: chains across full boundaries,
   stacks of equal lifetimes) and, when that shrinks the problem by a tenth or more, the problem
   of the blocks is packed first with up to ``_COARSE_SHARE`` of the budget: greedy, short dives,
   then rounds of short capacity probes (``_ladder``); a rectangle cut into tiles glues back into
   a few blocks. Its packing is one of the buffers with the same arena; it proves nothing (the
   stacks and pairs are guesses), so the proven bound comes from the search on the buffers
   themselves, which starts from the better packing;
3. then the problem is split into independent parts (no buffer crosses between them). Short
   bottom-left dives (searches with little room to backtrack) first try to lower each part's top;
   then a search over capacities ``C`` runs, lowest first: every part above ``C`` is searched
   (``search``) for a packing within ``C``. A part found to fit lowers the arena; a part
   proven not to fit raises the proven lower bound to the next possible arena above ``C``.
   Capacities are probed from the lower bound up, then halving the remaining gap, until the arena
   meets the proven bound (optimal) or the budget is spent (the gap is reported).

``seconds`` is turned into a fixed amount of search work (``WORK_PER_SECOND``, measured on the
development machine), so the same problem and budget always give the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack.coarsen import coarsen
from dctms.toolkit.pack.greedy import best_fit_within, greedy_orders
from dctms.toolkit.pack.online import online_best_fit
from dctms.toolkit.pack.problem import Problem, Sweep, granule, live_max, make_problem, sweep
from dctms.toolkit.pack.search import BUDGET, FOUND, INFEASIBLE, Outcome, PartSearch
from dctms.toolkit.pack.skyline import ORDERS, fill

# Search work (array elements touched, see search.py) per CPU second on the development machine.
WORK_PER_SECOND = 100_000_000
# A greedy order this close to the lower bound ends the greedy pass (the search may still close it).
GOOD_ENOUGH = 1e-4
# The first node limit of the round-robin over pre-orders, per buffer of the part (then doubled).
_FIRST_LIMIT_NODES = 4
# The greedy pass's work limit: a share of the budget, at least the floor (so that ``--seconds 0``
# still runs it on large problems), and what one candidate it examines costs in search work units
# (measured here: 40,000 buffers live at once, 4.7 units per candidate).
_GREEDY_SHARE = 0.25
_GREEDY_FLOOR = 50_000_000
_CANDIDATE_WORK = 5
# Nodes per buffer a dive may visit (it backtracks only a little).
_DIVE_NODES = 3
# The skyline search's first work limit per buffer of the part (then doubled), and its share.
_SKYLINE_FIRST_LIMIT = 20_000
_SKYLINE_SHARE = 0.5
# The glued problem's share of the budget, and its dives' share of that (on 2,000 tiles the
# short probes lower the arena, the dives barely: 1.21 -> 1.09 x the optimum for half the budget).
_COARSE_SHARE = 0.9
_COARSE_DIVE_SHARE = 0.05
# The glued problem's skyline probes' share of its budget (before the branch-and-bound probes).
_COARSE_SKYLINE_SHARE = 0.2
# How many orientations of the glued problem share its budget (as is, mirrored in time).
_GLUED_VARIANTS = 2
# The first work limit of the glued problem's capacity probes: its budget over this.
_LADDER_STEPS = 64
# A round of probes ends this close to the arena (a share of the gap to the bound): the last few
# granules below it are rarely worth a probe each.
_LADDER_NEAR = 8
# The glued problem is searched only when it has at most this share of the buffers' count.
_WORTH_GLUING = 0.9


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
    budget = int(seconds * WORK_PER_SECOND)
    best_offsets, best_arena = _greedy(p, sw, lower, budget)
    greedy_arena = best_arena
    if best_arena <= lower or budget <= 0:
        return Packing(best_offsets.tolist(), best_arena, lower, lower, greedy_arena)
    spent = 0
    glued = _glued(p, sw, lower, int(budget * _COARSE_SHARE))
    if glued is not None:
        offsets, arena, spent = glued
        if arena < best_arena:
            best_offsets, best_arena = offsets, arena
        if best_arena <= lower:
            return Packing(best_offsets.tolist(), best_arena, lower, lower, greedy_arena, spent)
    offsets, arena, bound, work = _search(p, sw, best_offsets, lower, budget - spent)
    return Packing(offsets.tolist(), arena, lower, bound, greedy_arena, spent + work)


def _greedy(p: Problem, sw: Sweep, lower: int, budget: int) -> tuple[np.ndarray, int]:
    """The best greedy order's offsets and arena, the orders' work within ``greedy_budget``;
    when not even the first order fits in it, the online allocator's packing."""
    best_offsets, best_arena = None, None
    limit = greedy_budget(budget) // _CANDIDATE_WORK
    for order in greedy_orders(p):
        placed = best_fit_within(p, sw, order, limit)
        if placed is None:
            break  # this order would take longer than the budget allows; the next ones too
        offsets, arena, work = placed
        limit -= work
        if best_arena is None or arena < best_arena:
            best_offsets, best_arena = offsets, arena
        if arena <= lower * (1 + GOOD_ENOUGH):
            break  # the other orders could gain at most GOOD_ENOUGH; the search may close it
    if best_arena is None:
        return online_best_fit(p)
    return best_offsets, best_arena


def greedy_budget(budget: int) -> int:
    """The greedy pass's work limit for a search budget (both in search work units)."""
    return max(_GREEDY_FLOOR, int(budget * _GREEDY_SHARE))


def _glued(p: Problem, sw: Sweep, lower: int, budget: int) -> tuple[np.ndarray, int, int] | None:
    """Offsets, arena and work of packing the blocks ``coarsen`` glues the buffers into
    (None when it glues nothing)."""
    glued = coarsen(sw.sec_lo, sw.sec_hi, p.size, p.align, lower)
    if glued.n > _WORTH_GLUING * int((p.size > 0).sum()):
        return None  # about the same problem: the search on the buffers does the same work
    best, best_arena, work = None, None, 0
    # The blocks as they are, then mirrored in time (a packing of one is a packing of the other;
    # the searches fill bottom-left, so they meet the blocks in another order): the better wins.
    for k, (lo, hi) in enumerate(((glued.lo, glued.hi), (-glued.hi, -glued.lo))):
        share = budget // _GLUED_VARIANTS if k < _GLUED_VARIANTS - 1 else budget - work
        q = make_problem(lo, hi, glued.size, glued.align)
        offsets, arena, used = _pack_blocks(q, lower, share)
        work += used
        if best_arena is None or arena < best_arena:
            best, best_arena = offsets, arena
        if best_arena <= lower or k + 1 >= _GLUED_VARIANTS:
            break
    return glued.expand(best), best_arena, work


def _pack_blocks(q: Problem, lower: int, budget: int) -> tuple[np.ndarray, int, int]:
    """Greedy, skyline probes, then branch-and-bound probes on the glued problem ``q``."""
    q_sw = sweep(q)
    offsets, arena = _greedy(q, q_sw, lower, budget)
    work = 0
    if arena > lower:
        sky = int(budget * _COARSE_SKYLINE_SHARE)
        offsets, arena, work = _skyline_ladder(q, q_sw, offsets, lower, sky)
    if arena > lower:
        offsets, arena, used = _ladder(q, q_sw, offsets, lower, budget - work)
        work += used
    return offsets, arena, work


def _parts(p: Problem, sw: Sweep, offsets: np.ndarray) -> tuple[list, list[int]]:
    """The independent parts (members, first and last section, the PartSearch made lazily) with
    the top of each in ``offsets``."""
    parts = []
    for members, first, last in sw.parts:
        members = members[p.size[members] > 0]  # empty buffers occupy nothing: offset as is
        if members.size:
            parts.append([members, first, last, None])
    return parts, [int((offsets[m] + p.size[m]).max()) for m, *_ in parts]


def _ladder(
    p: Problem, sw: Sweep, offsets: np.ndarray, lower: int, budget: int
) -> tuple[np.ndarray, int, int]:
    """Offsets, arena and work of short capacity probes (``_probe``): the lower bound, then
    halving the gap to the arena, each probe within a work limit; then again from the bound with
    the limit doubled, until the budget is spent. On glued problems a probe finds a packing at once
    or not for long, and at which capacities it does is erratic (measured on 2,000 tiles: found in
    0.14 s at 1.0337 and 1.0168 x the optimum, not in 5 s at 1.0217), so many short probes over
    the whole range beat a bisection of long ones."""
    offsets = offsets.copy()
    g = granule(p)
    parts, tops = _parts(p, sw, offsets)
    infeasible_at = [-1] * len(parts)
    spent = _dive(p, sw, parts, offsets, tops, g, lower, int(budget * _COARSE_DIVE_SHARE))

    def probe(capacity: int, limit: int, left: int) -> tuple[str, int]:
        return _probe(p, sw, parts, offsets, tops, infeasible_at, capacity, min(limit, left))

    spent = _climb(probe, tops, lower, g, budget, spent)
    return offsets, max(tops), spent


def _climb(probe, tops: list[int], floor: int, g: int, budget: int, spent: int) -> int:
    """The ladders' capacity search: probes from ``floor`` (capacities below it are proven too
    small) halving the gap to the arena (``max(tops)``, which a found probe lowers), each within
    a work limit that doubles per round; returns the work spent in all."""
    arena = max(tops)
    limit = max(budget // _LADDER_STEPS, 1)
    while floor < arena and spent < budget and limit <= 2 * budget:
        low, capacity = floor, floor
        while (arena - low) * _LADDER_NEAR > arena - floor and spent < budget:
            status, used = probe(capacity, limit, budget - spent)
            spent += used
            arena = max(tops)
            if status == INFEASIBLE:
                floor = max(floor, _next_multiple(capacity, g))
            if status != FOUND:
                low = _next_multiple(capacity, g)
            capacity = _mid(low, arena, g)
        limit *= 2
    return spent


def _skyline_ladder(
    p: Problem, sw: Sweep, offsets: np.ndarray, lower: int, budget: int
) -> tuple[np.ndarray, int, int]:
    """``_ladder``'s capacity probes made with the skyline search (``skyline.fill``, both
    orders) instead of the branch-and-bound: on glued problems it sometimes fits at once where the
    other does not in seconds (2,000 tiles, seed 14: 1.01 x the optimum in 0.004 s)."""
    offsets = offsets.copy()
    g = granule(p)
    parts, tops = _parts(p, sw, offsets)

    def probe(capacity: int, limit: int, left: int) -> tuple[str, int]:
        return _skyline_probe(p, sw, parts, offsets, tops, capacity, limit, left)

    spent = _climb(probe, tops, lower, g, budget, 0)
    return offsets, max(tops), spent


def _skyline_probe(p, sw, parts, offsets, tops, capacity: int, limit: int, budget: int):
    """Fit every part above ``capacity`` into it with the skyline search; FOUND only if all fit."""
    spent = 0
    for i in sorted((i for i in range(len(parts)) if tops[i] > capacity), key=lambda i: -tops[i]):
        members, first, last, _ = parts[i]
        lo, hi = sw.sec_lo[members] - first, sw.sec_hi[members] - first
        status = BUDGET
        for order in ORDERS:
            left = min(limit, budget - spent)
            if left <= 0:
                return BUDGET, spent
            out = fill(
                lo, hi, p.size[members], p.align[members], last - first, capacity, left, order
            )
            spent += out.work
            status = out.status
            if status == FOUND:
                offsets[members] = out.offsets
                tops[i] = int((out.offsets + p.size[members]).max())
            if status in (FOUND, INFEASIBLE):
                break
        if status != FOUND:
            return (INFEASIBLE if status == INFEASIBLE else BUDGET), spent
    return FOUND, spent


def _search(
    p: Problem, sw: Sweep, offsets: np.ndarray, lower: int, budget: int
) -> tuple[np.ndarray, int, int, int]:
    offsets = offsets.copy()
    g = granule(p)
    parts, tops = _parts(p, sw, offsets)
    infeasible_at = [-1] * len(parts)  # the highest capacity proven too small, per part
    arena = max(tops, default=0)
    bound, probe_floor = lower, lower
    spent = _dive(p, sw, parts, offsets, tops, g, lower, budget // 4)
    used, infeasible = _skyline(p, sw, parts, offsets, tops, lower, int(budget * _SKYLINE_SHARE))
    spent += used
    if infeasible:
        bound = probe_floor = _next_multiple(lower, g)
    arena = max(tops, default=0)
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
        members = parts[i][0]
        search, setup = _part_search(p, sw, parts, i, budget - spent)
        spent += setup
        if search is None:
            status = BUDGET
            continue
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


def _part_search(p: Problem, sw: Sweep, parts: list, i: int, budget: int) -> tuple:
    """The part's search state (built once) and the work of building it; None if over budget."""
    members, first, last, search = parts[i]
    if search is not None:
        return search, 0
    # Building the search costs about the sections its buffers span, several times over.
    setup = 4 * int((sw.sec_hi[members] - sw.sec_lo[members]).sum()) + search_overlap_cost(
        sw, members
    )
    if setup > budget:
        return None, 0
    parts[i][3] = PartSearch(p, sw, members, first, last)
    return parts[i][3], setup


def search_overlap_cost(sw: Sweep, members: np.ndarray) -> int:
    """Work of listing each buffer's overlaps (prefix scans over buffers sorted by start)."""
    lo, hi = sw.sec_lo[members], sw.sec_hi[members]
    return int(np.searchsorted(np.sort(lo), hi, side="left").sum())


def _dive(p, sw, parts, offsets, tops, g: int, lower: int, budget: int) -> int:
    """Short searches just below each part's best top, one per pre-order: with little room to
    backtrack they act as bottom-left constructive heuristics and often beat the greedy orders."""
    spent = 0
    for i in sorted(range(len(parts)), key=lambda i: -tops[i]):
        if tops[i] <= lower:
            continue
        search, setup = _part_search(p, sw, parts, i, budget - spent)
        spent += setup
        if search is None:
            continue
        improved = True
        while improved:  # again from every pre-order while some dive lowers the top
            improved = False
            for rank in search.ranks():
                dive = _DIVE_NODES * search.m * search.node_work() + search.dive_extra()
                left = min(budget - spent, dive)
                if left <= 0:
                    return spent
                if tops[i] - g < int(search.total0.max()):
                    improved = False
                    break  # this part is at its own lower bound
                outcome = search.fits(tops[i] - g, rank, left)
                spent += outcome.work
                if outcome.status == FOUND:
                    offsets[parts[i][0]] = outcome.offsets
                    tops[i] = int((outcome.offsets + search.size).max())
                    improved = True
    return spent


def _skyline(p, sw, parts, offsets, tops, lower: int, budget: int) -> tuple[int, bool]:
    """Fill each part above the lower bound bottom-left within it (``skyline``), cycling
    through its orders with a work limit that doubles. Returns the work spent and whether some
    part was proven not to fit in the lower bound."""
    spent = 0
    for i in sorted(range(len(parts)), key=lambda i: -tops[i]):
        if tops[i] <= lower:
            continue
        members, first, last, _ = parts[i]
        lo, hi = sw.sec_lo[members] - first, sw.sec_hi[members] - first
        limit = _SKYLINE_FIRST_LIMIT * members.size
        settled = False
        while not settled and spent < budget:
            for order in ORDERS:
                left = min(limit, budget - spent)
                if left <= 0:
                    break
                out = fill(
                    lo, hi, p.size[members], p.align[members], last - first, lower, left, order
                )
                spent += out.work
                if out.status == FOUND:
                    offsets[members] = out.offsets
                    tops[i] = int((out.offsets + p.size[members]).max())
                if out.status == INFEASIBLE:
                    return spent, True
                if out.status != BUDGET:
                    settled = True  # found, or exhausted without proof: other orders would be too
                    break
            limit *= 2
    return spent, False


def _round_robin(search: PartSearch, capacity: int, budget: int) -> tuple[Outcome, int]:
    """Each pre-order in turn with a node limit that doubles (MiniMalloc's restarts)."""
    spent = 0
    ranks = search.ranks()
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
