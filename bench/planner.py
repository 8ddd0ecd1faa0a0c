"""Planner benchmark: compile time and plan quality of the checked-in plans, and assigner scaling.

Usage: .venv/bin/python bench/planner.py [--repeat 3] [--tensors 50000]

Per checked-in config (plans/configs) it compiles in this process (imports warm, best of
--repeat) and reports Table 1 (logical tensors -> physical buffers, reduction) against the paper's
448 -> 122 (72.77 %), the arena against its lower bound, and two baselines measured on the same
plan in the same run: no reuse at all (every tenant its own bytes) and the paper's colouring
(one buffer per colour, each sized to its largest tenant). Then a synthetic set of --tensors
intervals goes through colouring, the lower bound and offset packing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAPER_LOGICAL, PAPER_PHYSICAL = 448, 122


def bench_plans(repeat: int) -> None:
    import mlx_lm.utils  # noqa: F401  (import cost is not compile cost)

    from dctms.schema.model_folder import open_model
    from dctms.schema.sizes import align_up, is_arena_tenant
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    print(
        f"{'plan':<34}{'compile s':>10}{'logical':>9}{'buffers':>9}{'reduction':>11}"
        f"{'arena/LB':>10}{'arena/no-reuse':>16}{'arena/colouring':>17}"
    )
    for config in sorted((ROOT / "plans/configs").glob("*.json")):
        src = open_model(config)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan = compile_plan(src, CompileOptions(2048, 256))
            times.append(time.perf_counter() - t0)
        s = plan.stats
        no_reuse = colouring = 0
        for phase in plan.phases:
            tenants = [t for t in phase.tensors if is_arena_tenant(t)]
            no_reuse = max(no_reuse, sum(align_up(t.bytes, 64) for t in tenants))
            colouring = max(colouring, sum(align_up(b.bytes, 64) for b in phase.buffers))
        print(
            f"{config.stem:<34}{min(times):>10.2f}{s.logical_tensors:>9,}{s.physical_buffers:>9,}"
            f"{s.reduction:>10.2%}{s.arena_bytes / s.lower_bound_bytes:>10.3f}"
            f"{s.arena_bytes / no_reuse:>16.3f}{s.arena_bytes / colouring:>17.3f}"
        )
    print(
        f"{'paper (Qwen2.5, hand-written)':<34}{'':>10}{PAPER_LOGICAL:>9}{PAPER_PHYSICAL:>9}"
        f"{1 - PAPER_PHYSICAL / PAPER_LOGICAL:>10.2%}"
    )


def bench_assigner(n: int) -> None:
    from dctms.toolkit import assign

    rng = random.Random(0)
    slots = n // 2
    intervals, sizes = [], []
    for _ in range(n):
        s = rng.randrange(slots)
        intervals.append((s, min(slots - 1, s + int(rng.expovariate(1 / 40)))))
        sizes.append(rng.choice([256, 4096, 65536, 1 << 20, 7 << 20]))
    aligned = [assign.align_up(x, 64) for x in sizes]
    t0 = time.perf_counter()
    _, buffer_size = assign.colour(intervals, sizes)
    t1 = time.perf_counter()
    lower = assign.lower_bound(intervals, aligned, slots)
    t2 = time.perf_counter()
    _, arena = assign.pack(intervals, sizes, 64, floor=lower)
    t3 = time.perf_counter()
    print(f"\nsynthetic {n:,} intervals over {slots:,} slots")
    print(
        f"  colouring   {t1 - t0:7.2f} s  -> {len(buffer_size):,} buffers "
        f"({1 - len(buffer_size) / n:.2%} reduction)"
    )
    print(f"  lower bound {t2 - t1:7.2f} s")
    print(f"  packing     {t3 - t2:7.2f} s  -> arena / lower bound = {arena / lower:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=50_000)
    args = ap.parse_args()
    bench_plans(args.repeat)
    bench_assigner(args.tensors)


if __name__ == "__main__":
    main()
