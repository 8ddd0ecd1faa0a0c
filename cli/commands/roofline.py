"""``dctms roofline PLAN [--profile NAME | --measure] [--prompt-tokens P] [--compare-bench DIR]``:
the plan's ops on the roofline of a target, and the decode speed and TTFT that allows."""

from __future__ import annotations

import argparse
import json
import sys

from dctms.cli.compile_options import PROFILE_NAMES
from dctms.schema.errors import DctmsError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "roofline",
        help="bytes moved, FLOPs and roofline time per phase and op class; predicted tok/s, TTFT",
        description=(
            "For every phase of PLAN and every op class (matmul, quantized matmul, elementwise, "
            "reduction, gather, kv update, copy, view): FLOPs, bytes moved (weights, KV cache, "
            "activations, MLX scratch copies), arithmetic intensity, whether it is memory- or "
            "compute-bound on the target profile, and its roofline time (each op: max(FLOPs / "
            "peak, bytes / bandwidth); ops one after another). From those: the time per decode "
            "token, tok/s at the roofline, and TTFT for a prompt of --prompt-tokens. The roofline "
            "is a lower bound on time; --compare-bench prints it against a measurement."
        ),
    )
    p.add_argument("plan", metavar="PLAN", help="plan file")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        help="target profile (default: the plan's own, or for a CPU plan scheduled on the "
        "reference-BLAS cpu-x86-2core, cpu-x86-2core-openblas: the BLAS dctms runs with)",
    )
    which.add_argument(
        "--measure",
        action="store_true",
        help="measure this machine's read bandwidth and matmul throughput with MLX and use them",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="P",
        help="prompt length for the TTFT prediction (default: the plan's N)",
    )
    p.add_argument(
        "--compare-bench",
        metavar="SUMMARY",
        help="a `dctms bench` summary.json (or its folder) of this plan: print predicted / measured",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.figures.roofline import plan_roofline, prediction_profile, roofline_doc
    from dctms.schema.io import read_plan
    from dctms.views.roofline_bench import compare_with_bench, read_bench_summary
    from dctms.views.roofline_text import comparison_text, roofline_text

    plan = read_plan(args.plan)
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= plan.bounds.input_tokens:
        raise DctmsError(
            f"--prompt-tokens must be between 1 and the plan's N = {plan.bounds.input_tokens:,}, "
            f"got {args.prompt_tokens:,}"
        )
    bench = read_bench_summary(args.compare_bench) if args.compare_bench else None
    if args.measure:
        from dctms.benchmark.machine import measured_profile

        profile = measured_profile()
    elif args.profile:
        from dctms.toolkit.profiles import get_profile

        profile = get_profile(args.profile)
    else:
        profile = prediction_profile(plan)
    roof = plan_roofline(plan, profile, args.prompt_tokens)
    comparison = compare_with_bench(plan, profile, bench) if bench is not None else None
    if args.json:
        doc = roofline_doc(roof)
        if comparison is not None:
            doc["bench"] = comparison
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        text = roofline_text(plan, roof)
        if comparison is not None:
            text += comparison_text(comparison)
        sys.stdout.write(text)
    return 0
