"""The skyline search: its packings are valid, its infeasibility proofs agree with brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from dctms.toolkit.pack.instances import tiles
from dctms.toolkit.pack.problem import Problem, live_max, make_problem, sweep
from dctms.toolkit.pack.search import BUDGET, FOUND, INFEASIBLE
from dctms.toolkit.pack.skyline import EXHAUSTED, ORDERS, fill
from dctms.toolkit.pack.solve import solve


def _fill(p: Problem, capacity: int, budget: int = 10**9, order: str = "largest"):
    sw = sweep(p)
    return fill(sw.sec_lo, sw.sec_hi, p.size, p.align, sw.n_sections, capacity, budget, order)


def _valid(p: Problem, offsets, capacity: int) -> bool:
    """Pairwise, independently of the packer's helpers: aligned, within capacity, disjoint."""
    for i in range(p.n):
        if offsets[i] < 0 or offsets[i] % p.align[i] or offsets[i] + p.size[i] > capacity:
            return False
        for j in range(i):
            together = p.start[i] < p.end[j] and p.start[j] < p.end[i]
            apart = offsets[i] + p.size[i] <= offsets[j] or offsets[j] + p.size[j] <= offsets[i]
            if together and p.size[i] and p.size[j] and not apart:
                return False
    return True


def _brute_fits(p: Problem, capacity: int) -> bool:
    """Whether some aligned offsets fit within ``capacity`` (every combination: tiny only)."""
    ranges = [range(0, capacity - int(p.size[i]) + 1, int(p.align[i])) for i in range(p.n)]
    return any(_valid(p, list(offs), capacity) for offs in itertools.product(*ranges))


def _uniform_tiny(seed: int) -> Problem | None:
    """A tiny random problem with the same bytes live in every section (no slack at its bound),
    or None when the draw is not uniform."""
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    starts = [rng.randrange(3) for _ in range(n)]
    ends = [s + rng.randint(1, 3) for s in starts]
    sizes = [rng.randint(1, 3) for _ in range(n)]
    p = make_problem(starts, ends, sizes, 1)
    sw = sweep(p)
    if len(sw.parts) != 1:
        return None
    live = np.zeros(sw.n_sections, dtype=np.int64)
    for lo, hi, z in zip(sw.sec_lo, sw.sec_hi, p.size, strict=True):
        live[lo:hi] += z
    return p if live.min() == live.max() else None


_UNIFORM = [p for p in map(_uniform_tiny, range(20000)) if p is not None][:40]


@pytest.mark.parametrize("k", range(len(_UNIFORM)))
def test_without_slack_the_search_decides_exactly_as_brute_force(k: int) -> None:
    p = _UNIFORM[k]
    capacity = live_max(p)
    out = _fill(p, capacity)
    assert out.status in (FOUND, INFEASIBLE)  # no slack: every answer is exact
    assert out.status == (FOUND if _brute_fits(p, capacity) else INFEASIBLE)
    if out.status == FOUND:
        assert _valid(p, out.offsets.tolist(), capacity)


@pytest.mark.parametrize(("e_align", "fits"), [(4, False), (2, True)])
def test_an_infeasible_instance_without_slack_is_proven_so(e_align: int, fits: bool) -> None:
    # 4 bytes live in every section. A (align 4) can only sit at 0, so B sits at 2 and D, which
    # meets B, at 0; E meets D and must sit at 2: impossible at alignment 4, fine at 2.
    #            A  F  B  D  E
    p = make_problem([0, 0, 1, 2, 3], [2, 1, 3, 4, 4], [2, 2, 2, 2, 2], [4, 1, 1, 1, e_align])
    assert live_max(p) == 4 and _brute_fits(p, 4) == fits
    out = _fill(p, 4)
    assert out.status == (FOUND if fits else INFEASIBLE)
    r = solve(p, seconds=1.0)
    assert (r.arena == 4) == fits and r.bound > 4 - fits  # the solver's proof agrees


@pytest.mark.parametrize("seed", range(40))
def test_with_slack_a_packing_is_valid_and_a_failure_claims_no_proof(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    starts = [rng.randrange(5) for _ in range(n)]
    ends = [s + rng.randint(1, 4) for s in starts]
    sizes = [rng.randint(1, 4) for _ in range(n)]
    p = make_problem(starts, ends, sizes, [rng.choice([1, 1, 2]) for _ in range(n)])
    capacity = live_max(p) + rng.randint(0, 2)
    out = _fill(p, capacity)
    if out.status == FOUND:
        assert _valid(p, out.offsets.tolist(), capacity)
    elif out.status == INFEASIBLE:
        assert not _brute_fits(p, capacity)
    else:
        assert out.status == EXHAUSTED


@pytest.mark.parametrize("order", ORDERS)
def test_tiles_fill_their_rectangle(order: str) -> None:
    p, _ = tiles(80, seed=2, width=1 << 16, span=400)
    out = _fill(p, 1 << 16, order=order)
    assert out.status == FOUND
    assert _valid(p, out.offsets.tolist(), 1 << 16)


def test_a_capacity_below_the_live_bytes_is_refused_at_once() -> None:
    p, _ = tiles(50, seed=1, width=1 << 12, span=100)
    assert _fill(p, (1 << 12) - 64).status == INFEASIBLE


def test_the_budget_stops_the_search_at_the_same_node() -> None:
    p, _ = tiles(2000, seed=0)
    first = _fill(p, 1 << 20, budget=2_000_000)
    again = _fill(p, 1 << 20, budget=2_000_000)
    assert first.status == again.status == BUDGET
    assert first.work == again.work


def test_solve_reaches_the_optimum_of_500_tiles_with_a_small_budget() -> None:
    # Seed 1 needed 2.5 CPU s of branch-and-bound before the skyline search ran first.
    p, _ = tiles(500, seed=1)
    r = solve(p, seconds=0.5)
    assert r.arena == 1 << 20 and r.proof == "lower_bound"
    assert _valid(p, r.offsets, 1 << 20)
