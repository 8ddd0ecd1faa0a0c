"""``dctms check PLAN... [--model DIR | --config FILE] [--write]``: is each plan still up to date?

Re-compiles every plan from the request it records (its model config and compile options) and
compares the bytes. Exit status: 0 when every plan re-compiles to itself; 1 when one is stale (a
different compiler, tool version or model gives another plan) or was edited, one line each naming
the first differing figure; 2 for bad input (an unreadable or invalid plan, a missing model).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dctms.cli.hf_cache import add_download_flag
from dctms.schema.errors import DctmsError, PlanError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="re-compile plans from what they record; fail when a checked-in plan is stale",
        description=(
            "Re-compile each PLAN from the request it records (the model's config.json and every "
            "compile option as given) and compare with the file. Without --model/--config the "
            "recorded config is used, so a new compiler or mlx version shows as drift; with one "
            "the model as it is now is compiled, so a changed model shows too. Prints 'PLAN: ok' "
            "or 'PLAN: stale|edited: FIRST DIFFERENCE; re-make with: dctms compile ...'. Exit 0 "
            "when all plans are up to date, 1 when one is stale or edited, 2 for bad input."
        ),
    )
    p.add_argument("plans", nargs="+", metavar="PLAN", help="plan file(s) to check")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model", metavar="DIR", help="model folder (config.json + safetensors) to compile"
    )
    which.add_argument("--config", metavar="FILE", help="config.json to compile")
    p.add_argument(
        "--write",
        action="store_true",
        help="replace each stale plan with its re-compile (edited plans are left alone)",
    )
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms import check_plan

    model = args.model or args.config
    if args.model is not None and not Path(args.model).is_dir():
        raise DctmsError(f"--model {args.model}: not a folder (give a config.json with --config)")
    if args.config is not None and not Path(args.config).is_file():
        raise DctmsError(f"--config {args.config}: no such file")
    status = 0
    for path in args.plans:
        try:
            recorded = None if model is not None else recorded_hub_model(path, args.download)
            result = check_plan(path, model=model or recorded, write=args.write)
        except PlanError as err:
            for problem in err.problems:
                print(problem.line(err.source), file=sys.stderr)
            status = 2
            continue
        except DctmsError as err:
            print(f"dctms check: {err}", file=sys.stderr)
            status = max(status, err.exit_code)
            continue
        if result.ok:
            print(result.line())
        else:
            print(result.line(), file=sys.stderr)
            status = max(status, 1)
    return status


def recorded_hub_model(path: str, download: bool) -> str | None:
    """The snapshot folder of the Hugging Face id and commit a plan records (``compile
    ORG/NAME``), found in this machine's cache; None for a plan compiled from a folder or a config,
    or one whose snapshot is not cached and that records no weight hashes (its recorded config is
    then compiled, as for any plan). A plan that needs its weights and cannot find them is one line
    naming the cache and the fetch command."""
    from dctms.cli.hf_cache import find_snapshot
    from dctms.schema.io import read_plan

    try:
        plan = read_plan(path)
    except (DctmsError, OSError):
        return None  # check_plan reports it
    hub = plan.compile.hub if plan.compile is not None else None
    if hub is None:
        return None
    try:
        label = f"{path}: records the Hugging Face id {hub.repo_id}, but"
        return str(find_snapshot(hub.repo_id, hub.revision, download, label).path)
    except DctmsError:
        if plan.model.weights.files_sha256 is None:
            return None
        raise
