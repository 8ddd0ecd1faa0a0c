"""``dctms show PLAN [--json]``: bounds, memory envelope, Table 1 figures, arena vs lower bound."""

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
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hint = model_config_hint(args.plan)  # the usual slip: the model's config for its plan
    if hint is not None:
        raise DctmsError(hint)
    if Path(args.plan).is_dir():  # the rank plans `dctms compile --ranks` wrote
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
    if args.json:
        sys.stdout.write(json.dumps(_summary(plan), indent=2) + "\n")
    else:
        sys.stdout.write(show_text(plan))
    return 0


def _summary(plan) -> dict:
    return {
        "envelope": msgspec.to_builtins(plan.envelope),
        "stats": msgspec.to_builtins(plan.stats),
        "bounds": msgspec.to_builtins(plan.bounds),
    }
