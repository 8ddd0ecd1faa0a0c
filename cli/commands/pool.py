"""``dctms pool PLAN... --memory SIZE [--concurrent] [--json]``: several plans in one process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dctms.schema.errors import DctmsError

EXIT_DOES_NOT_FIT = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pool",
        help="combined M_max of several plans served by one process; do they fit a budget?",
        description=(
            "Compose the envelopes of plans that live in one process (as `dctms serve` runs them): "
            "weights, KV cache and persistent state are summed; the intermediate arena is shared "
            "(the largest) when calls run one at a time, summed with --concurrent; the runtime "
            "allowance is paid once per process. Prints which plans fit --memory and the free "
            f"bytes; exits {EXIT_DOES_NOT_FIT} with the shortfall when they do not fit."
        ),
    )
    p.add_argument(
        "plans", nargs="+", metavar="PLAN", help="plan files; NAME=PLAN names one (default: stem)"
    )
    p.add_argument("--memory", metavar="SIZE", required=True, help="budget, e.g. 16GiB")
    p.add_argument(
        "--concurrent", action="store_true", help="calls may overlap: sum the arenas, not max"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def named_plan_paths(specs: list[str]) -> list[tuple[str, Path]]:
    """``NAME=PLAN`` or ``PLAN`` (named after its file stem); names must be unique."""
    out: list[tuple[str, Path]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not name or not path:
            raise DctmsError(f"{spec!r}: expected PLAN or NAME=PLAN")
        if any(name == n for n, _ in out):
            raise DctmsError(f"two plans are named {name!r}; name them apart with NAME=PLAN")
        out.append((name, Path(path)))
    return out


def run(args: argparse.Namespace) -> int:
    from dctms.figures.pool import pool_of, pool_summary
    from dctms.figures.units import parse_size
    from dctms.schema.io import read_plan
    from dctms.views.pool import pool_text

    try:
        budget = parse_size(args.memory)
    except DctmsError as err:
        raise DctmsError(f"--memory: {err}") from None
    plans = [(name, read_plan(path)) for name, path in named_plan_paths(args.plans)]
    pool = pool_of(plans, concurrent=args.concurrent, budget=budget)
    if args.json:
        sys.stdout.write(json.dumps(pool_summary(pool), indent=2) + "\n")
    else:
        sys.stdout.write(pool_text(pool))
    if not pool.fits:
        print(
            f"dctms pool: the pool needs {pool.total:,} bytes, {-(pool.free or 0):,} more than "
            f"the {budget:,}-byte budget",
            file=sys.stderr,
        )
        return EXIT_DOES_NOT_FIT
    return 0
