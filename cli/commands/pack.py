"""``dctms pack FILE.csv [--seconds S] [--json] [-o OUT.csv]``: the offset packer on any problem."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.output import Output, reserve_output


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pack",
        help="pack buffers with lifetimes into one arena (offsets, arena, optimality)",
        description=(
            "Give every buffer of FILE.csv (columns id,start,end,size and optionally alignment; "
            "a buffer is live over the half-open range [start, end)) an offset so that buffers "
            "live at the same time never share bytes, in as small an arena as possible: greedy "
            "best-fit first, then an exact branch-and-bound search when the greedy arena is "
            "above the lower bound (the most bytes live at once). Prints the arena, the lower "
            "bound, whether the arena is proven optimal (else the gap) and the time taken."
        ),
    )
    p.add_argument("file", metavar="FILE.csv", help="the problem: id,start,end,size[,alignment]")
    p.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="search budget (default 10; a fixed amount of work, so results are reproducible; "
        "the greedy pass may use a quarter of it, at least 0.5 s of work, then an online "
        "allocator packs instead)",
    )
    p.add_argument(
        "--alignment",
        type=int,
        default=1,
        help="offset alignment of rows without an alignment column (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "-o", "--output", metavar="OUT.csv", help="write id,offset rows there ('-': stdout)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.seconds <= 3600:
        raise DctmsError(f"--seconds must be between 0 and 3600, got {args.seconds}")
    if not 1 <= args.alignment <= 2**30:
        raise DctmsError(f"--alignment must be between 1 and 2^30, got {args.alignment}")
    source = Path(args.file)
    if args.output is None or args.output == "-":
        return _pack(args, source, None)
    # Checked (and the file reserved) before any work: never a device, a folder or the input.
    with reserve_output(args.output, inputs=[source], label=f"-o {args.output}") as out:
        return _pack(args, source, out)


def _pack(args: argparse.Namespace, source: Path, out: Output | None) -> int:
    from dctms.toolkit.pack.csv_io import offsets_csv, parse_csv
    from dctms.toolkit.pack.solve import solve

    ids, problem = parse_csv(_read_text(source), args.file, args.alignment)
    t0, c0 = time.perf_counter(), time.process_time()
    result = solve(problem, args.seconds)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    summary = {
        "buffers": problem.n,
        "arena": result.arena,
        "lower_bound": result.lower_bound,
        "ratio": result.arena / result.lower_bound if result.lower_bound else 1.0,
        "proven_optimal": result.proven_optimal,
        "proof": result.proof,
        "gap": result.gap,
        "greedy_arena": result.greedy_arena,
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
    }
    offsets = offsets_csv(ids, result.offsets).encode()
    if out is not None:
        out.write(offsets)
    elif args.output == "-":
        sys.stdout.buffer.write(offsets)
        sys.stdout.flush()
    text = json.dumps(summary) if args.json else _describe(summary)
    print(text, file=sys.stderr if args.output == "-" else sys.stdout)
    return 0


def _describe(s: dict) -> str:
    if s["proof"] == "lower_bound":
        optimal = "proven (arena = lower bound)"
    elif s["proof"] == "search":
        optimal = "proven (exhaustive search: no smaller arena fits)"
    else:
        share = s["gap"] / s["arena"] if s["arena"] else 0.0
        optimal = f"not proven: at most {s['gap']:,} bytes ({share:.2%}) above the optimum"
    return "\n".join(
        [
            f"buffers       {s['buffers']:,}",
            f"arena         {s['arena']:,} bytes",
            f"lower bound   {s['lower_bound']:,} bytes",
            f"ratio         {s['ratio']:.4f}",
            f"optimal       {optimal}",
            f"greedy arena  {s['greedy_arena']:,} bytes",
            f"time          {s['seconds']:.2f} s ({s['cpu_seconds']:.2f} s CPU)",
        ]
    )


def _read_text(path: Path) -> str:
    try:
        if not path.is_file():
            raise DctmsError(f"{path}: not a file" if path.exists() else f"{path}: no such file")
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DctmsError(f"{path}: not UTF-8 text") from None
    except OSError as err:
        raise DctmsError(f"{path}: cannot read: {err.strerror or err}") from None
