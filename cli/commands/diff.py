"""``dctms diff OLD NEW``: what changed between two plans, and whether M_max grew too much.

Exit status: 0 within the thresholds, 1 when ``--fail-above`` or ``--budget`` is crossed (the reason
is printed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    p.add_argument(
        "old",
        metavar="OLD",
        help="plan before the change (e.g. the base branch's); or a folder of rank plans",
    )
    p.add_argument("new", metavar="NEW", help="plan after the change (a folder when OLD is one)")
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
    labels = (args.old_label or args.old, args.new_label or args.new)
    if Path(args.old).is_dir() and Path(args.new).is_dir():  # two folders of rank plans
        from dctms.schema.ranks import read_rank_plans

        olds, news = read_rank_plans(args.old), read_rank_plans(args.new)
        if len(olds) != len(news):
            raise DctmsError(f"{args.old} has {len(olds)} ranks, {args.new} has {len(news)}")
        pairs = [
            (f"rank {r}", diff_data(o, n, *(f"{x} rank {r}" for x in labels), thresholds, budget))
            for r, (o, n) in enumerate(zip(olds, news, strict=True))
        ]
    else:
        pairs = [
            ("", diff_data(read_plan(args.old), read_plan(args.new), *labels, thresholds, budget))
        ]
    if args.format == "json":
        doc = pairs[0][1] if len(pairs) == 1 else {"ranks": [d for _, d in pairs]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render = diff_markdown if args.format == "markdown" else diff_text
        sys.stdout.write("\n".join(render(d) for _, d in pairs))
    failed = False
    for name, data in pairs:
        for failure in data["verdict"]["failures"]:
            print(f"dctms diff: {name + ': ' if name else ''}{failure}", file=sys.stderr)
            failed = True
    return 1 if failed else 0
