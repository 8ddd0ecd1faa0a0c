"""``dctms explain PLAN [--phase P] [--json] [--knobs LIST | --no-knobs] [--model DIR]``: why the
envelope is this big, in the model's terms, and what each knob would change (measured by
re-compiling the plan's recorded request with that knob changed)."""

from __future__ import annotations

import argparse
import json
import sys

from dctms.cli.hf_cache import add_download_flag
from dctms.schema.errors import DctmsError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "explain",
        help="why M_max is this big: components by module, what drives them, the peaks, the knobs",
        description=(
            "Explain a plan in the model's terms: what each envelope component is made of "
            "(weights by module group, the KV cache by layer, the peak's live tensors by module "
            "with shapes and dtypes), which bounds drive each, and what halving the prefill chunk, "
            "N or M would change, measured by re-compiling the plan's recorded request (a few "
            "seconds per knob for a 7B model; --no-knobs skips them)."
        ),
    )
    p.add_argument("plan", metavar="PLAN", help="plan file")
    p.add_argument("--phase", metavar="P", help="explain only this phase's peak (prefill, decode)")
    p.add_argument("--json", action="store_true", help="print the same figures as JSON")
    knobs = p.add_mutually_exclusive_group()
    knobs.add_argument(
        "--knobs",
        metavar="LIST",
        default="chunk,N,M",
        help="knobs to re-compile with, comma-separated from chunk, N, M (halved) and batch "
        "(doubled); default chunk,N,M",
    )
    knobs.add_argument("--no-knobs", action="store_true", help="no re-compiles: the plan alone")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder or config.json to re-compile (default: the config the plan records)",
    )
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.figures.explain import explain, knob_effect
    from dctms.schema.io import read_plan
    from dctms.views.explain import explain_data, explain_text

    plan = read_plan(args.plan)
    names = [p.name for p in plan.phases]
    if args.phase is not None and args.phase not in names:
        raise DctmsError(f"--phase {args.phase}: the plan has phases {', '.join(names)}")
    ex = explain(plan, args.phase)
    effects = None
    if not args.no_knobs:
        from dctms.toolkit.knobs import compile_knobs

        chosen = tuple(k.strip() for k in args.knobs.split(",") if k.strip())
        say = (
            (lambda msg: print(f"dctms explain: {msg}", file=sys.stderr)) if not args.json else None
        )
        baseline, compiled = compile_knobs(plan, chosen, args.model, say)
        effects = [knob_effect(k.knob, k.old, k.new, baseline, k.plan) for k in compiled]
    if args.json:
        sys.stdout.write(json.dumps(explain_data(ex, effects), indent=2) + "\n")
    else:
        sys.stdout.write(explain_text(ex, effects))
    return 0
