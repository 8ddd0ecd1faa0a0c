"""``dctms show PLAN [--json] [--run REPORT.json]``: bounds, memory envelope, Table 1 figures, arena
vs lower bound; with ``--run``, the plan's prompt-prefix pool over a recorded run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from dctms.cli.inputs import model_config_hint
from dctms.schema.errors import DctmsError
from dctms.schema.io import read_plan
from dctms.views.show import show_text


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "show",
        help="summarise a plan: envelope (M_max), Table 1 figures, arena vs lower bound",
        description=(
            "Print a plan's bounds, memory envelope (weights, kv, persistent, intermediate, runtime, "
            "total = M_max, device, free) in bytes and MiB, the interval-colouring figures next to "
            "the paper's Table 1, and each phase's arena against its lower bound. The plan is "
            "validated first."
        ),
    )
    parser.add_argument(
        "plan", metavar="PLAN", help="plan file, or the folder of rank plans compile --ranks wrote"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"envelope": {...}, "stats": {...}, "bounds": {...}} instead (integer bytes)',
    )
    parser.add_argument(
        "--run",
        metavar="REPORT",
        help=(
            "also draw the plan's prompt-prefix pool over a recorded run: the JSON report of "
            "`dctms run PLAN --conversation FILE --report REPORT` (a block map: . free, 1-9 a-z "
            "the prompt chunk a block holds; per turn the blocks hit, saved and evicted)"
        ),
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hint = model_config_hint(args.plan)  # the usual slip: the model's config for its plan
    if hint is not None:
        raise DctmsError(hint)
    if Path(args.plan).is_dir():  # the rank plans `dctms compile --ranks` wrote
        if args.run is not None:
            raise DctmsError("--run draws one plan's prefix pool: give a plan file, not a folder")
        from dctms.schema.ranks import read_rank_plans
        from dctms.views.ranks import rank_table

        plans = read_rank_plans(args.plan)
        if args.json:
            doc = {
                "ranks": [
                    dict(_summary(p), distributed=msgspec.to_builtins(p.distributed)) for p in plans
                ]
            }
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        else:
            texts = [rank_table(plans)] + [show_text(p) for p in plans]
            sys.stdout.write("\n\n".join(t.rstrip("\n") for t in texts) + "\n")
        return 0
    plan = read_plan(args.plan)
    pool_run = None
    if args.run is not None:
        from dctms.figures.prefix_run import read_pool_run

        pool_run = read_pool_run(args.run, plan, Path(args.plan).name)
    if args.json:
        doc = _summary(plan)
        if pool_run is not None:
            doc["pool_run"] = _pool_run_json(pool_run)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    elif pool_run is not None:
        from dctms.views.prefix_run import pool_run_text

        sys.stdout.write(show_text(plan) + "\n" + pool_run_text(pool_run) + "\n")
    else:
        sys.stdout.write(show_text(plan))
    return 0


def _pool_run_json(run) -> dict:
    """The pool over the run: the final map, totals and one row per turn (maps after each)."""
    from dctms.figures.prefix_run import block_map, turn_rows

    return {
        "blocks": run.blocks,
        "block_tokens": run.block_tokens,
        "map": block_map(run.table, run.block_tokens),
        "hit_blocks": run.hit_blocks,
        "saved_blocks": run.saved_blocks,
        "evictions": run.evictions,
        "cached_tokens": run.cached_tokens,
        "turns": [vars(r) for r in turn_rows(run)],
    }


def _summary(plan) -> dict:
    return {
        "envelope": msgspec.to_builtins(plan.envelope),
        "stats": msgspec.to_builtins(plan.stats),
        "bounds": msgspec.to_builtins(plan.bounds),
    }
