"""``dctms diff OLD NEW``: what changed between two plans, and whether M_max grew too much.

Exit status: 0 within the thresholds, 1 when ``--fail-above`` or ``--budget`` is crossed (the reason
is printed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from dctms.schema.errors import DctmsError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diff",
        help="compare two plans: envelope, Table 1 figures, bounds, model; fail on growth",
        description=(
            "Compare two plans: the memory envelope by component (bytes, MiB, %), the "
            "interval-colouring figures (logical tensors, physical buffers, reduction), arena per "
            "phase, bounds and target, and the model fingerprint (architecture, config sha256, "
            "weights count / bytes / layout sha256, quantisation). Exit 1 when M_max grew by more "
            "than a --fail-above threshold or NEW's M_max exceeds --budget, 2 for bad input."
        ),
    )
    p.add_argument("old", metavar="OLD", help="plan before the change (e.g. the base branch's)")
    p.add_argument("new", metavar="NEW", help="plan after the change")
    p.add_argument(
        "--format",
        choices=["text", "markdown", "json"],
        default="text",
        help="text (terminal), markdown (a PR comment) or json (same numbers, for scripts)",
    )
    p.add_argument(
        "--fail-above",
        metavar="LIMIT",
        action="append",
        default=[],
        help="exit 1 when M_max grew by more than LIMIT: a percentage (2%%) or a size (64MiB); "
        "may be repeated",
    )
    p.add_argument(
        "--budget", metavar="SIZE", help="exit 1 when NEW's M_max exceeds SIZE (e.g. 16GiB)"
    )
    p.add_argument("--old-label", metavar="NAME", help="name OLD in the report (default: its path)")
    p.add_argument("--new-label", metavar="NAME", help="name NEW in the report (default: its path)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.figures.units import parse_size
    from dctms.schema.io import read_plan
    from dctms.views.diff import diff_data, diff_markdown, diff_text, parse_threshold

    # Parse the limits first: a typo should not cost reading two 2 MB plans.
    thresholds = tuple(parse_threshold(t) for t in args.fail_above)
    try:
        budget = parse_size(args.budget) if args.budget is not None else None
    except DctmsError as err:
        raise DctmsError(f"--budget: {err}") from None
    old, new = read_plan(args.old), read_plan(args.new)
    labels = (args.old_label or args.old, args.new_label or args.new)
    data = diff_data(old, new, *labels, thresholds, budget)
    if args.format == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(diff_markdown(data))
    else:
        sys.stdout.write(diff_text(data))
    if not data["verdict"]["ok"]:
        for failure in data["verdict"]["failures"]:
            print(f"dctms diff: {failure}", file=sys.stderr)
        return 1
    return 0
