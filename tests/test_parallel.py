"""Checks spread over forked workers (``dctms.toolkit.parallel``) give the serial result, in order,
and the compiler's length-point verification is the same with one worker or two."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import TINY_QWEN2

from dctms.toolkit import parallel
from dctms.toolkit.parallel import MIN_ITEMS_PER_WORKER, default_jobs, parallel_map

linux = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def _square_and_pid(offset: int, x: int) -> tuple[int, int]:
    return x * x + offset, os.getpid()


@linux
def test_workers_return_the_serial_results_in_order() -> None:
    items = list(range(4 * MIN_ITEMS_PER_WORKER))
    got = parallel_map(_square_and_pid, 3, items, jobs=2)
    assert [v for v, _ in got] == [x * x + 3 for x in items]
    assert os.getpid() not in {pid for _, pid in got}  # computed in forked workers
    assert parallel._work is None  # the inherited inputs are released


def test_few_items_or_one_job_stay_in_this_process() -> None:
    few = list(range(2 * MIN_ITEMS_PER_WORKER - 1))  # too few for two workers
    assert {pid for _, pid in parallel_map(_square_and_pid, 0, few, jobs=2)} == {os.getpid()}
    many = list(range(4 * MIN_ITEMS_PER_WORKER))
    assert {pid for _, pid in parallel_map(_square_and_pid, 0, many, jobs=1)} == {os.getpid()}


def test_the_environment_sets_the_workers(monkeypatch) -> None:
    monkeypatch.delenv("DCTMS_COMPILE_JOBS", raising=False)
    assert default_jobs() == 1  # opt-in: no forked workers unless asked
    monkeypatch.setenv("DCTMS_COMPILE_JOBS", "2")
    assert default_jobs() == min(2, len(os.sched_getaffinity(0)))
    monkeypatch.setenv("DCTMS_COMPILE_JOBS", "0")
    assert default_jobs() == 1
    monkeypatch.setenv("DCTMS_COMPILE_JOBS", "many")
    assert default_jobs() == 1


@linux
def test_verified_points_do_not_depend_on_the_workers() -> None:
    from dctms.toolkit import compiler as C
    from dctms.toolkit.lengths import verified_points
    from dctms.toolkit.lifetimes import analyse

    # A fine grid (step 1) gives every length point up to the bounds: dozens of candidates.
    opts = C.CompileOptions(40, 12, prefill_chunk=16, token_step=1, window_step=1)
    settings = C.resolve_settings(TINY_QWEN2, None, opts)
    traced, _, fits = C.trace_source(dict(TINY_QWEN2), None, opts, settings, lambda _m: None)
    rules = C.memory_rules(settings.backend, opts.run_ahead)
    for tp in traced.phases:
        lf = fits[tp.name]
        views = {i for i, op in enumerate(tp.ops) if op.primitive in C.VIEW_ALWAYS | C.RESHAPES}
        sched = C.build_schedule(tp, views, C.ridge_point(settings.profile), opts.sync_every)
        lives = analyse(tp, sched, rules)
        candidates = C._candidates(lf, opts)
        assert len(candidates) >= 2 * MIN_ITEMS_PER_WORKER
        serial = verified_points(tp, lf, sched, lives, candidates, rules, jobs=1)
        forked = verified_points(tp, lf, sched, lives, candidates, rules, jobs=2)
        assert forked == serial
        kept, dropped = serial
        assert kept[0] == lf.bound and len(kept) + len(dropped) == len(set(candidates) | {lf.bound})
