"""``dctms show PLAN [--json]``: bounds, memory envelope, Table 1 figures, arena vs lower bound."""

from __future__ import annotations

import argparse
import json
import sys

import msgspec

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
    parser.add_argument("plan", metavar="PLAN", help="plan file")
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"envelope": {...}, "stats": {...}, "bounds": {...}} instead (integer bytes)',
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan)
    if args.json:
        summary = {
            "envelope": msgspec.to_builtins(plan.envelope),
            "stats": msgspec.to_builtins(plan.stats),
            "bounds": msgspec.to_builtins(plan.bounds),
        }
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        sys.stdout.write(show_text(plan))
    return 0
