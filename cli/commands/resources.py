"""``dctms resources PLAN... [--for serve|run] [--format text|k8s|compose|systemd|json]``: the memory
request and limit a container needs for a dctms process, each term named."""

from __future__ import annotations

import argparse
import sys

from dctms.views.resources import FORMATS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "resources",
        help="the memory request and limit a container needs for these plans (k8s, compose, systemd)",
        description=(
            "Print the memory a container, systemd unit or cgroup must grant a dctms process that "
            "serves (or runs) these plans: the pool's M_max as `dctms pool` composes it (weights, "
            "KV, persistent state, the arena, MLX's buffer cache, the process baseline and, for "
            "`dctms serve`, its HTTP stack), each term named, rounded up to whole MiB; the request "
            "equals the limit."
        ),
    )
    p.add_argument(
        "plans", nargs="+", metavar="PLAN", help="plan files; NAME=PLAN names one (default: stem)"
    )
    p.add_argument(
        "--for",
        dest="process",
        choices=["serve", "run"],
        default="serve",
        help="the process: dctms serve (default; counts its HTTP stack) or dctms run",
    )
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (default text)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.cli.commands.pool import named_plan_paths
    from dctms.figures.pool import pool_of
    from dctms.figures.resources import resources_of
    from dctms.schema.io import read_plan
    from dctms.serve.allowance import serving_extras
    from dctms.views.resources import render

    serving = args.process == "serve"
    plans = [(name, read_plan(path)) for name, path in named_plan_paths(args.plans)]
    pool = pool_of(plans, extras=serving_extras() if serving else ())
    sys.stdout.write(render(resources_of(pool, serving), args.format))
    return 0
