"""``dctms fit MODEL --memory 16GiB (-M INT | -N INT)``: the longest prompt (or generation) that fits.

Exit status: 0 with the fit printed, 1 when even 1 token does not fit (the shortfall is printed),
2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from dctms.schema.errors import DctmsError

if TYPE_CHECKING:
    from dctms.schema.types import Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit",
        help="largest N (given -M) or M (given -N) whose M_max fits a memory budget",
        description=(
            "Search for the largest number of input tokens N (given -M) or output tokens M (given "
            "-N) whose plan's M_max fits --memory: compile at 1, 2, 4, ... until it does not fit, "
            "then bisect, so about 2*log2(answer) compiles. N + M stops at the config's "
            "max_position_embeddings (else 2^20). Prints the envelope at the fit."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="model folder or config.json")
    p.add_argument("--memory", metavar="SIZE", required=True, help="budget, e.g. 16GiB")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("-M", "--output-tokens", type=int, help="fixed M: search the largest N")
    which.add_argument("-N", "--input-tokens", type=int, help="fixed N: search the largest M")
    p.add_argument("--batch", type=int, default=1, help="sequences per call (default 1)")
    p.add_argument(
        "--prefill-chunk", type=int, help="tokens per prefill call (default min(N, 512))"
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], help="model dtype (default: config)"
    )
    p.add_argument("--alignment", type=int, default=64, help="arena alignment in bytes (64)")
    p.add_argument("-o", "--output", metavar="PLAN", help="also write the plan at the fit")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.figures.units import human, parse_size
    from dctms.schema.io import write_plan
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.model_source import load_source
    from dctms.views.fit import (
        DEFAULT_CAP,
        fit_summary,
        fit_text,
        largest_fitting,
        max_positions,
    )

    try:
        budget = parse_size(args.memory)
    except DctmsError as err:
        raise DctmsError(f"--memory: {err}") from None
    search_n = args.output_tokens is not None
    fixed = args.output_tokens if search_n else args.input_tokens
    letter, other = ("N", "M") if search_n else ("M", "N")
    if fixed < 1:
        raise DctmsError(f"-{other} must be at least 1, got {fixed}")
    source = load_source(args.model)
    limit = max_positions(source.config)
    cap = DEFAULT_CAP if limit is None else limit - fixed
    cap_reason = (
        f"{letter} = 2^20" if limit is None else f"max_position_embeddings {limit:,} (N + M)"
    )
    if cap < 1:
        raise DctmsError(
            f"{other} = {fixed:,} leaves no room: the model's max_position_embeddings is {limit:,}"
        )

    start = time.perf_counter()
    fitting: dict[int, Plan] = {}  # the largest plan that fits, so it is not compiled twice

    def measure(value: int) -> int:
        n, m = (value, fixed) if search_n else (fixed, value)
        opts = CompileOptions(
            input_tokens=n,
            output_tokens=m,
            batch=args.batch,
            prefill_chunk=args.prefill_chunk,
            dtype=args.dtype,
            device_memory=budget,
            alignment=args.alignment,
        )
        plan = compile_plan(source, opts)
        total = plan.envelope.total
        if total <= budget and value > max(fitting, default=0):
            fitting.clear()
            fitting[value] = plan
        if not args.quiet:
            verdict = "fits" if total <= budget else f"over by {human(total - budget)}"
            print(
                f"[{time.perf_counter() - start:6.2f}s] {letter} = {value:,}: "
                f"M_max {human(total)}, {verdict}",
                file=sys.stderr,
            )
        return total

    result = largest_fitting(measure, budget, cap)
    elapsed = time.perf_counter() - start
    if result.best is None:
        first = result.probes[0]
        short = first.total - budget
        print(
            f"dctms fit: even {letter} = 1 ({other} = {fixed:,}) needs M_max {human(first.total)}: "
            f"{human(short)} ({short:,} bytes) more than the {human(budget)} budget",
            file=sys.stderr,
        )
        if args.json:
            doc = {"value": None, "budget": budget, "m_max_at_1": first.total, "shortfall": short}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 1
    plan = fitting[result.best]
    summary = fit_summary(result, plan, "input_tokens" if search_n else "output_tokens", elapsed)
    if args.output:
        write_plan(plan, args.output)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        model = f"{plan.model.architecture} ({plan.model.num_layers} layers)"
        sys.stdout.write(fit_text(summary, model, cap_reason))
    return 0
