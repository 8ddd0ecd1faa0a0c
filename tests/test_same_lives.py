"""toolkit.same_lives: a length point is proven to keep the bound's lives only where pass 3 itself,
re-run at that point, finds the bound's decisions -- over every point of fine grids, where some
points do change a decision -- and the compiler's verified points are pass 3's own."""

from __future__ import annotations

import pytest
from conftest import TINY_QWEN2

from dctms.toolkit import compiler as C
from dctms.toolkit import lengths as L
from dctms.toolkit.lifetimes import analyse, graph_facts
from dctms.toolkit.same_lives import PointChecker

CASES = {
    "cpu": C.CompileOptions(40, 12, prefill_chunk=16, token_step=1, window_step=1),
    "batched": C.CompileOptions(24, 8, batch=3, prefill_chunk=8, token_step=1, window_step=1),
    "metal": C.CompileOptions(
        40, 12, prefill_chunk=16, token_step=1, window_step=1, target="metal"
    ),
    "throttled": C.CompileOptions(
        40, 12, prefill_chunk=16, token_step=1, window_step=1, run_ahead="throttled"
    ),
}


def _phases(opts: C.CompileOptions):
    """(phase, fit, schedule, the bound's lives, rules, candidates) of each traced phase."""
    settings = C.resolve_settings(TINY_QWEN2, None, opts)
    traced, _, fits = C.trace_source(dict(TINY_QWEN2), None, opts, settings, lambda _m: None)
    rules = C.memory_rules(settings.backend, opts.run_ahead, settings.memory_model)
    for tp in traced.phases:
        lf = fits.get(tp.name)
        if lf is None:
            continue
        views = {i for i, op in enumerate(tp.ops) if op.primitive in C.VIEW_ALWAYS | C.RESHAPES}
        sched = C.build_schedule(tp, views, C.ridge_point(settings.profile), opts.sync_every)
        yield tp, lf, sched, analyse(tp, sched, rules), rules, C._candidates(lf, opts)


@pytest.fixture(scope="module")
def phases() -> dict[str, list]:
    return {name: list(_phases(opts)) for name, opts in CASES.items()}


def test_proven_points_are_exactly_pass_3s_kept_points(phases) -> None:
    proven = kept = changed = 0
    for name, found in phases.items():
        for tp, lf, sched, lives, rules, candidates in found:
            facts = graph_facts(tp, sched, rules)
            checker = PointChecker(tp, lf, sched, lives, rules, facts)
            work = (tp, lf, sched, lives, rules, facts)
            for point in {tuple(p) for p in candidates} - {lf.bound}:
                why = L._why_not(work, point)
                ok = checker.same_lives(point)
                assert ok == (why == ""), (name, tp.name, point, why)
                proven += ok
                kept += why == ""
                changed += why != ""
    # The grids reach points where a decision does change (a size-1 axis, a donation): the
    # checker must say no there, not only yes everywhere.
    assert changed > 0 and proven == kept > 100


def test_the_compilers_points_are_pass_3s(phases) -> None:
    for found in phases.values():
        for tp, lf, sched, lives, rules, candidates in found:
            got = L.verified_points(tp, lf, sched, lives, candidates, rules, jobs=1)
            facts = graph_facts(tp, sched, rules)
            work = (tp, lf, sched, lives, rules, facts)
            kept, dropped = [lf.bound], []
            for point in [tuple(p) for p in candidates if tuple(p) != lf.bound]:
                why = L._why_not(work, point)
                if why:
                    dropped.append(f"{point}: {why}")
                else:
                    kept.append(point)
            assert got == (kept, dropped)


def test_a_point_above_the_bound_is_not_proven(phases) -> None:
    tp, lf, sched, lives, rules, _ = phases["cpu"][0]
    checker = PointChecker(tp, lf, sched, lives, rules, graph_facts(tp, sched, rules))
    assert checker.same_lives(lf.bound)
    above = tuple(n + 1 for n in lf.bound)
    assert not checker.same_lives(above)  # larger tensors: pass 3 says "larger than at the bound"
    assert L._why_not((tp, lf, sched, lives, rules, graph_facts(tp, sched, rules)), above)


def test_lives_that_are_not_pass_3s_at_the_bound_prove_nothing(phases) -> None:
    """The proof starts from pass 3's result at the bound: handed other lives (here pass 3's
    without donation, whose intervals and kinds differ), the checker proves no point, as pass 3
    compared with those lives keeps none."""
    tp, lf, sched, lives, rules, candidates = phases["cpu"][0]
    facts = graph_facts(tp, sched, rules)
    other = analyse(tp, sched, L.MemoryRules(donation=False, run_ahead=rules.run_ahead))
    assert other != lives
    honest = PointChecker(tp, lf, sched, lives, rules, facts)
    points = [tuple(p) for p in candidates if tuple(p) != lf.bound and honest.same_lives(p)]
    assert len(points) > 10
    checker = PointChecker(tp, lf, sched, other, rules, facts)
    assert not any(checker.same_lives(p) for p in [lf.bound, *points])
    assert all(L._why_not((tp, lf, sched, other, rules, facts), p) for p in points)


def test_a_replay_that_is_not_pass_3s_at_the_bound_proves_nothing(phases, monkeypatch) -> None:
    """Should pass 3 ever compute an op's cost on a path the replay lacks (here: the replay
    sees 8 bytes more scratch for every matmul), the replay disagrees with pass 3's own result at
    the bound, and the checker leaves every point to pass 3."""
    from dctms.toolkit import same_lives

    tp, lf, sched, lives, rules, candidates = phases["cpu"][0]
    facts = graph_facts(tp, sched, rules)
    points = [tuple(p) for p in candidates if tuple(p) != lf.bound]
    honest = PointChecker(tp, lf, sched, lives, rules, facts)
    assert any(honest.same_lives(p) for p in points)
    real = same_lives.op_cost

    def other(primitive, *args):
        mem, scratch, dispatches = real(primitive, *args)
        return mem, scratch + 8 if primitive == "Matmul" else scratch, dispatches

    monkeypatch.setattr(same_lives, "op_cost", other)
    checker = PointChecker(tp, lf, sched, lives, rules, facts)
    assert not any(checker.same_lives(p) for p in [lf.bound, *points])
