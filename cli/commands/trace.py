"""``dctms trace PLAN -o trace.json``: the plan's memory as a Chrome/Perfetto trace."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace",
        help="export planned memory as a Chrome/Perfetto trace (JSON trace event format)",
        description=(
            "Write the plan's memory as a trace for ui.perfetto.dev or chrome://tracing: one "
            "process per phase, one track per physical buffer with each arena tenant as a span "
            "(args: bytes, offset, buffer, shape, producing op), counters of live bytes and arena "
            "extent per slot, and the sync points. The time axis counts schedule slots, not "
            "microseconds: a viewer's 1 us is one slot."
        ),
    )
    p.add_argument("plan", metavar="PLAN", help="plan file")
    p.add_argument(
        "-o", "--output", metavar="FILE", required=True, help="trace file to write (- for stdout)"
    )
    p.add_argument("--phase", metavar="NAME", help="only this phase (default: every phase)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.schema.output import reserve_output

    if args.output == "-":
        return _run(args, None)
    # Checked (and the file reserved) before any work: never a device, a folder or the plan.
    with reserve_output(args.output, inputs=[args.plan], label=f"-o {args.output}") as target:
        return _run(args, target)


def _run(args: argparse.Namespace, target) -> int:
    from dctms.schema.io import read_plan
    from dctms.views.dot import select_phase
    from dctms.views.trace import phase_events, trace_document

    plan = read_plan(args.plan)
    document = trace_document(plan)
    if args.phase is not None:
        phase = select_phase(plan, args.phase)
        pid = plan.phases.index(phase) + 1
        document["traceEvents"] = phase_events(plan, phase, pid)
    text = json.dumps(document, separators=(",", ":")) + "\n"
    if target is None:
        sys.stdout.write(text)
        return 0
    target.write(text.encode("utf-8"))
    spans = sum(1 for e in document["traceEvents"] if e["ph"] == "X")
    print(
        f"wrote {args.output}: {spans:,} tenant spans; open in https://ui.perfetto.dev "
        "(time axis: schedule slots, shown as us)",
        file=sys.stderr,
    )
    return 0
