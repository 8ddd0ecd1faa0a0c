"""``dctms selftest [--backend cpu|gpu] [--report FILE]``: compile a tiny model on this machine, run
it, print provable vs observed memory and the ids against mlx-lm's; a JSON report to attach to an
issue."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "selftest",
        help="compile and run a tiny model here: provable vs observed memory, ids vs mlx-lm",
        description=(
            "Confirm dctms on your own machine: build a tiny random-weight model, compile its plan "
            "here (--backend gpu: for this machine's GPU, --target metal or cuda, whose memory "
            "model is modelled from MLX's source), run it in a fresh process, and print the "
            "provable peak, the simulator's peak and MLX's observed peak, and whether the "
            "generated ids equal mlx-lm's own. Exit 0 when the run stayed within the envelope and "
            "the ids are equal, 1 otherwise, 2 for bad input (e.g. --backend gpu without a GPU)."
        ),
    )
    p.add_argument(
        "--backend",
        choices=["cpu", "gpu"],
        default="cpu",
        help="MLX device to test (default cpu; gpu: this machine's Metal or CUDA GPU)",
    )
    p.add_argument("--report", metavar="FILE", help="also write the figures as JSON to FILE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.benchmark.selftest import report_json, report_text, run_selftest, target_for
    from dctms.schema.output import reserve_output

    target_for(args.backend)  # refuse --backend gpu without a GPU before any work

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.report is None:
        report = run_selftest(args.backend, say=say)
    else:
        with reserve_output(args.report, label=f"--report {args.report}") as out:
            report = run_selftest(args.backend, say=say)
            out.write(report_json(report).encode())
    print("\n".join(report_text(report)))
    if args.report:
        print(f"selftest: report written to {Path(args.report)} (attach it to an issue)")
    return 0 if report.ok else 1
