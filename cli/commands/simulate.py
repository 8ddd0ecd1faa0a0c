"""``dctms simulate PLAN``: replay the plan through its target's allocator model; exit 1 when the
simulated active-memory peak exceeds the provable envelope."""

from __future__ import annotations

import argparse
import json
import sys

from dctms.schema.io import read_plan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a plan through its target's allocator model and check its peak",
        description=(
            "Replay PLAN's allocations and frees through a Python model of its target's allocator "
            "(cpu; metal and cuda as modelled from MLX's source): buffers freed only when MLX's "
            "host and its slowest allowed worker let them go, rounding and the buffer cache's "
            "reuse applied. Prints each phase's active-memory peak and the verdict against the "
            "provable envelope (weights + kv + persistent + intermediate). Exit status 0 when the "
            "peak is within it, 1 when it exceeds it, 2 for a plan that cannot be read."
        ),
    )
    p.add_argument("plan", metavar="PLAN", help="plan file")
    p.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.figures.units import human
    from dctms.toolkit.simulate import report_lines, simulate

    sim = simulate(read_plan(args.plan))
    if args.json:
        doc = {
            "target": sim.target,
            "static": sim.static,
            "phases": [{"name": p.name, "replay": p.replay, "worst": p.worst} for p in sim.phases],
            "peak": sim.peak,
            "provable": sim.provable,
            "ok": sim.ok,
        }
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(report_lines(sim, human)))
    if not sim.ok:
        print(
            f"dctms simulate: {args.plan}: the simulated peak exceeds the envelope", file=sys.stderr
        )
        return 1
    return 0
