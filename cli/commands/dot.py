"""``dctms dot PLAN --view {lifetimes,buffers,graph} -o FILE``: Graphviz pictures of a plan.

``.dot``/``.gv`` is written by Python alone; ``.svg``/``.png``/``.pdf`` are laid out by Graphviz's
``dot`` program, which is not a Python package and may be missing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dctms.schema.errors import DctmsError

if TYPE_CHECKING:
    import graphviz

SOURCE_SUFFIXES = (".dot", ".gv")
RENDER_SUFFIXES = (".svg", ".png", ".pdf")
INSTALL_HINT = (
    "install Graphviz (apt-get install graphviz, or brew install graphviz on macOS) "
    "or write a .dot file instead"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dot",
        help="draw a phase as Graphviz: tensor lifetimes, buffer reuse, or the op graph",
        description=(
            "Draw one phase of a plan with Graphviz (by default the phase with the peak). lifetimes: "
            "every arena tenant as a bar on a time axis in schedule slots, one row per physical "
            "buffer, labelled with the module that made it. buffers: each physical "
            "buffer with the tensors that reuse it. graph: the op graph clustered by decoder "
            "layer, edges labelled with shapes; selections of more than 400 ops are collapsed "
            "to one node per layer unless --flat (a tensor computed once and read by every later "
            "layer, such as the rotary angles, is noted on its layer rather than drawn). streams (a vision-language plan): one cluster "
            "per stream with the sync points where they meet. The output format follows the file "
            "extension: .dot/.gv (no Graphviz needed), .svg/.png/.pdf (needs the dot program)."
        ),
    )
    p.add_argument("plan", metavar="PLAN", help="plan file")
    p.add_argument(
        "--view",
        choices=["lifetimes", "buffers", "graph", "streams"],
        default="lifetimes",
        help="what to draw (streams: a vision-language plan's streams and sync points)",
    )
    p.add_argument(
        "--phase", help="phase to draw (default: the one with the peak, whose arena is M_intermediate)"
    )
    p.add_argument(
        "--layers", metavar="A-B", help="only decoder layers A..B (inclusive; model-level ops out)"
    )
    p.add_argument("--flat", action="store_true", help="graph view: one node per op, always")
    p.add_argument(
        "-o", "--output", metavar="FILE", required=True, help="FILE.dot, .svg, .png or .pdf"
    )
    p.set_defaults(func=run)


def parse_layers(text: str | None) -> tuple[int, int] | None:
    """``"3-5"`` -> (3, 5); ``"4"`` -> (4, 4)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise DctmsError(f"--layers wants A-B (e.g. 0-3) or one layer number, got {text!r}")
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if first > last:
        raise DctmsError(f"--layers {text}: the first layer is after the last")
    return first, last


def run(args: argparse.Namespace) -> int:
    from dctms.schema.output import reserve_output

    # Checked (and the file reserved) before any work: never a device, a folder or the plan.
    with reserve_output(args.output, inputs=[args.plan], label=f"-o {args.output}") as target:
        return _run(args, target)


def _run(args: argparse.Namespace, target) -> int:
    from dctms.schema.io import read_plan
    from dctms.views import dot as views

    out = Path(args.output)
    suffix = out.suffix.lower()
    if suffix not in SOURCE_SUFFIXES + RENDER_SUFFIXES:
        raise DctmsError(
            f"{args.output}: unknown output type {suffix or '(none)'}; use .dot, .svg, .png or .pdf"
        )
    # Check for the binary before any work, so a missing Graphviz costs nothing.
    if suffix in RENDER_SUFFIXES and shutil.which("dot") is None:
        raise DctmsError(f"{suffix[1:]} output needs the Graphviz 'dot' program: {INSTALL_HINT}")
    layers = parse_layers(args.layers)
    plan = read_plan(args.plan)
    if args.view == "streams":
        from dctms.views.dot_streams import streams_graph

        target.write(_encode(streams_graph(plan), suffix))
        return 0
    phase = views.select_phase(plan, args.phase)
    if layers is not None and layers[0] >= plan.model.num_layers:
        raise DctmsError(
            f"--layers {args.layers}: the model has layers 0-{plan.model.num_layers - 1}"
        )
    if args.view == "lifetimes":
        graph = views.lifetimes_graph(plan, phase, layers)
    elif args.view == "buffers":
        graph = views.buffers_graph(plan, phase, layers)
    else:
        graph, collapsed = views.op_graph(plan, phase, layers, flat=args.flat)
        if collapsed:
            print(
                f"dctms dot: {phase.name} has more than {views.FLAT_LIMIT} ops in the selection: "
                "drawn one node per layer (--flat for every op, --layers A-B to narrow)",
                file=sys.stderr,
            )
    target.write(_encode(graph, suffix))
    return 0


def _encode(graph: graphviz.Digraph, suffix: str) -> bytes:
    return graph.source.encode("utf-8") if suffix in SOURCE_SUFFIXES else _render(graph, suffix[1:])


def _render(graph: graphviz.Digraph, fmt: str) -> bytes:
    import graphviz

    try:
        return graph.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound:
        raise DctmsError(f"{fmt} output needs the Graphviz 'dot' program: {INSTALL_HINT}") from None
    except graphviz.CalledProcessError as err:
        detail = (err.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise DctmsError(f"Graphviz failed: {detail[-1] if detail else err}") from None
