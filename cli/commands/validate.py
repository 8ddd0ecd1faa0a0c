"""``dctms validate PLAN...``: schema and semantic checks, every problem of every plan."""

from __future__ import annotations

import argparse
import sys

from dctms.schema.errors import PlanError
from dctms.schema.io import read_plan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check plan files against the schema and the semantic verifier",
        description=(
            "Check each PLAN: JSON syntax, schema_version, the JSON Schema and every semantic rule "
            "(dataflow, intervals, buffer and arena overlap, envelope sums, stats). Prints "
            "'PLAN: ok (N ops, M tensors)' for a valid plan, else one line per problem on stderr: "
            "'PLAN: <json path>: <what is wrong>'. Exit status 0 when all plans are valid, else 2."
        ),
    )
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan file(s) to check")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    status = 0
    for path in args.plans:
        try:
            plan = read_plan(path, for_run=True)  # every rule: what run checks
        except PlanError as err:
            for problem in err.problems:
                print(problem.line(err.source), file=sys.stderr)
            status = 2
            continue
        ops = sum(len(phase.ops) for phase in plan.phases)
        tensors = sum(len(phase.tensors) for phase in plan.phases)
        print(f"{path}: ok ({ops} ops, {tensors} tensors)")
    return status
