"""The offset packer: greedy, exact search and the claims it makes, against brute force."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dctms.toolkit.pack.instances import tiles
from dctms.toolkit.pack.problem import Problem, live_max, make_problem
from dctms.toolkit.pack.solve import solve


def _overlap_free(p: Problem, offsets: list[int]) -> bool:
    """Pairwise, independently of the packer's own helpers."""
    for i in range(p.n):
        if offsets[i] < 0 or offsets[i] % p.align[i]:
            return False
        for j in range(i):
            live_together = p.start[i] < p.end[j] and p.start[j] < p.end[i]
            apart = offsets[i] + p.size[i] <= offsets[j] or offsets[j] + p.size[j] <= offsets[i]
            if live_together and p.size[i] and p.size[j] and not apart:
                return False
    return True


def _brute_optimum(p: Problem) -> int:
    """The smallest arena by trying every aligned offset of every buffer (tiny problems only)."""
    order = sorted(range(p.n), key=lambda i: -p.size[i])
    conflicts = {
        i: [j for j in range(p.n) if j != i and p.start[i] < p.end[j] and p.start[j] < p.end[i]]
        for i in range(p.n)
    }

    def fits(capacity: int) -> bool:
        offsets: dict[int, int] = {}

        def place(k: int) -> bool:
            if k == len(order):
                return True
            i = order[k]
            size, align = int(p.size[i]), int(p.align[i])
            for o in range(0, capacity - size + 1, align):
                if all(
                    o + size <= offsets[j] or offsets[j] + p.size[j] <= o
                    for j in conflicts[i]
                    if j in offsets
                ):
                    offsets[i] = o
                    if place(k + 1):
                        return True
                    del offsets[i]
            return False

        return place(0)

    capacity = live_max(p)
    while not fits(capacity):
        capacity += 1
    return capacity


def _tiny(seed: int) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    starts = [rng.randrange(6) for _ in range(n)]
    ends = [s + rng.randint(1, 4) for s in starts]
    sizes = [rng.randint(1, 4) for _ in range(n)]
    aligns = [rng.choice([1, 1, 2]) for _ in range(n)]
    return make_problem(starts, ends, sizes, aligns)


@pytest.mark.parametrize("seed", range(150))
def test_search_finds_the_brute_force_optimum_and_proves_it(seed: int) -> None:
    p = _tiny(seed)
    optimum = _brute_optimum(p)
    result = solve(p, seconds=5.0)
    assert _overlap_free(p, result.offsets)
    assert max(o + s for o, s in zip(result.offsets, p.size.tolist(), strict=True)) == result.arena
    assert result.arena == optimum, (result, optimum)
    assert result.proven_optimal and result.gap == 0
    assert result.lower_bound <= result.bound <= optimum
    assert result.proof == ("lower_bound" if optimum == result.lower_bound else "search")


def test_brute_force_cases_include_optima_above_the_lower_bound() -> None:
    # Otherwise the test above would never exercise a "search" proof.
    above = [s for s in range(150) if _brute_optimum(_tiny(s)) > live_max(_tiny(s))]
    assert len(above) >= 3
    assert all(solve(_tiny(s), seconds=5.0).proof == "search" for s in above)


@pytest.mark.parametrize("n", [40, 120])
def test_tiles_reach_the_known_optimum(n: int) -> None:
    p, construction = tiles(n, seed=3, width=1 << 16, span=400)
    assert _overlap_free(p, construction)  # the generator's own packing is valid and optimal
    assert live_max(p) == 1 << 16
    result = solve(p, seconds=10.0)
    assert _overlap_free(p, result.offsets)
    assert result.arena == 1 << 16 and result.proof == "lower_bound"


def test_random_problems_pack_validly_with_and_without_search() -> None:
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 60)
        starts = [rng.randrange(50) for _ in range(n)]
        ends = [s + rng.randint(1, 20) for s in starts]
        sizes = [rng.choice([0, 64, 128, 192, 1024]) for _ in range(n)]
        p = make_problem(starts, ends, sizes, 64)
        for seconds in (0.0, 0.2):
            r = solve(p, seconds)
            assert _overlap_free(p, r.offsets)
            assert r.lower_bound <= r.bound <= r.arena <= r.greedy_arena
            assert r.gap == r.arena - r.bound
            assert (r.proof is None) == (r.gap > 0)


def test_budget_limited_search_is_deterministic() -> None:
    p, _ = tiles(300, seed=5)
    first = solve(p, seconds=0.05)
    again = solve(p, seconds=0.05)
    assert first == again


def test_offsets_do_not_depend_on_the_span_of_time_values() -> None:
    rng = random.Random(11)
    n = 400
    starts = [rng.randrange(2000) for _ in range(n)]
    ends = [s + rng.randint(1, 60) for s in starts]
    sizes = [rng.choice([64, 256, 4096]) for _ in range(n)]
    near = solve(make_problem(starts, ends, sizes, 64))
    stretched = [t * 1_000_003 + 7 for t in starts], [t * 1_000_003 + 7 for t in ends]
    far = solve(make_problem(*stretched, sizes, 64))
    assert near.offsets == far.offsets and near.arena == far.arena


def test_live_max_by_hand() -> None:
    # [0, 3) 64, [1, 2) 128, [2, 3) 64, [3, 4) 500: ends free their bytes before starts at the
    # same time, so the 500 never meets the others.
    p = make_problem([0, 1, 2, 3], [3, 2, 3, 4], [64, 128, 64, 500], 1)
    assert live_max(p) == 500
    assert live_max(make_problem([0, 1, 2], [3, 2, 3], [64, 128, 64], 1)) == 192


def test_empty_problem() -> None:
    r = solve(make_problem([], [], [], 1), seconds=1.0)
    assert r.offsets == [] and r.arena == 0 and r.proof == "lower_bound"


def test_offsets_are_aligned_per_buffer() -> None:
    p = make_problem([0, 0, 0], [1, 1, 1], [3, 5, 7], [1, 8, 4])
    r = solve(p, seconds=1.0)
    assert _overlap_free(p, r.offsets)
    assert all(o % a == 0 for o, a in zip(r.offsets, [1, 8, 4], strict=True))
    assert np.all(np.asarray(r.offsets) >= 0)


def test_online_best_fit_packs_validly() -> None:
    """The fallback allocator against the pairwise check: ties in time, zero sizes, alignments
    that make a large enough hole useless, holes that merge and a top that sinks."""
    from dctms.toolkit.pack.online import online_best_fit

    rng = random.Random(23)
    for _ in range(60):
        n = rng.randint(1, 80)
        starts = [rng.randrange(30) for _ in range(n)]
        ends = [s + rng.randint(1, 12) for s in starts]
        sizes = [rng.choice([0, 1, 3, 64, 100, 4096]) for _ in range(n)]
        aligns = [rng.choice([1, 2, 64, 4096]) for _ in range(n)]
        p = make_problem(starts, ends, sizes, aligns)
        offsets, arena = online_best_fit(p)
        assert _overlap_free(p, offsets.tolist())
        assert arena == max(int(o + s) for o, s in zip(offsets, p.size, strict=True))
        assert arena >= live_max(p)


def test_online_best_fit_reuses_freed_bytes() -> None:
    # a and b freed at 2; c (start 2) takes the merged hole they leave, not the top.
    p = make_problem([0, 0, 0, 2], [2, 2, 5, 4], [40, 24, 8, 64], 1)
    offsets, arena = online_best_fit_of(p)
    assert offsets[3] == 0 and arena == 72


def online_best_fit_of(p: Problem):
    from dctms.toolkit.pack.online import online_best_fit

    return online_best_fit(p)


def test_greedy_past_its_work_limit_falls_back_to_the_online_allocator(monkeypatch) -> None:
    """The greedy pass examines every placed buffer a placement may overlap: with thousands live
    at once it is quadratic, so past its share of the budget the online allocator packs instead
    (40,000 identical buffers took over 20 s before, whatever --seconds said)."""
    from dctms.toolkit.pack import solve as pack_solve

    rng = random.Random(3)
    n = 600
    starts = [rng.randrange(100) for _ in range(n)]
    sizes = [rng.choice([64, 128, 4096]) for _ in range(n)]
    p = make_problem(starts, [s + 500 for s in starts], sizes, 64)
    within = solve(p, 0.0)
    monkeypatch.setattr(pack_solve, "_GREEDY_FLOOR", 1000)  # a few hundred candidates
    cut = solve(p, 0.0)
    assert _overlap_free(p, cut.offsets)
    online_offsets, online_arena = online_best_fit_of(p)
    assert cut.greedy_arena == online_arena
    assert cut.offsets == online_offsets.tolist() != within.offsets
    assert cut.arena == cut.lower_bound  # all 600 live from 99 to 500: a stack
