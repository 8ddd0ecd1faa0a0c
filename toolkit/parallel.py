"""Independent, pure checks spread over forked worker processes, results in the input's order.

The compiler re-runs pass 3 at every length point (``toolkit.lengths``): each point is a pure
function of the same large, read-only inputs (a 7B phase is thousands of ops), so forked workers
inherit those inputs instead of receiving them pickled, and return one short string per point.
The result is the serial result, item for item, whatever the number of workers: plans stay
byte-identical.

Only where ``fork`` is safe and there is more than one core to use: on Linux. macOS's Metal and
Objective-C runtimes must not be forked after use, and ``spawn`` would re-import MLX and pickle the
inputs for every worker, so elsewhere the checks run in this process.
Opt-in: ``DCTMS_COMPILE_JOBS=N`` asks for N workers; by default (1) the checks run in this process.
On this project's 2-core machine the workers gave no measurable wall-clock gain, and a fork of a
process whose MLX and BLAS threads may hold locks is a risk a default should not take.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Below this many items a fork (tens of ms for a large process) costs more than it saves.
MIN_ITEMS_PER_WORKER = 8

_work: Any = None  # the inputs the forked workers inherit (set only while a pool is up)
_fn: Callable[[Any, Any], Any] | None = None


def default_jobs() -> int:
    """``DCTMS_COMPILE_JOBS`` when set (Linux only), else 1: no workers."""
    given = os.environ.get("DCTMS_COMPILE_JOBS")
    if given is None or sys.platform != "linux":
        return 1
    try:
        return max(1, min(int(given), len(os.sched_getaffinity(0))))
    except ValueError:
        return 1


def parallel_map(
    fn: Callable[[Any, Any], Any], work: Any, items: Sequence[Any], jobs: int | None = None
) -> list[Any]:
    """``[fn(work, x) for x in items]``, over up to ``jobs`` forked workers (default
    ``default_jobs()``); ``fn`` must be a module-level function, its results picklable."""
    global _work, _fn
    jobs = min(default_jobs() if jobs is None else jobs, len(items) // MIN_ITEMS_PER_WORKER)
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(work, x) for x in items]
    _work, _fn = work, fn
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return pool.map(_call, items, chunksize=-(-len(items) // jobs))
    finally:
        _work = _fn = None


def _call(item: Any) -> Any:
    assert _fn is not None  # set by parallel_map before the fork
    return _fn(_work, item)
