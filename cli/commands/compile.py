"""``dctms compile MODEL -N INT -M INT [-o PLAN]``: trace a model and write its memory plan."""

from __future__ import annotations

import argparse
import sys
import time

from dctms.toolkit.sizes import human, parse_size

# Known target profiles, listed here so `--help` needs no compiler import (a test keeps them equal).
PROFILE_NAMES = ("apple-m4-16gb", "cpu-x86-2core")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compile",
        help="trace an mlx-lm model and write its memory plan",
        description=(
            "Trace the real MLX graph of an mlx-lm model (weights are never materialised), "
            "derive every tensor's lifetime, pack intermediates into one arena, schedule slots "
            "and sync points, and write the plan with its memory envelope M_max. MODEL is a "
            "folder holding config.json (safetensors optional) or a config.json path."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="model folder or config.json")
    p.add_argument("-N", "--input-tokens", type=int, required=True, help="longest prompt (tokens)")
    p.add_argument("-M", "--output-tokens", type=int, required=True, help="most generated tokens")
    p.add_argument("-o", "--output", metavar="PLAN", help="plan file to write (default: stdout)")
    p.add_argument("--batch", type=int, default=1, help="sequences per call (default 1)")
    p.add_argument(
        "--prefill-chunk", type=int, help="tokens per prefill call (default min(N, 512))"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="model dtype (default: the config's torch_dtype, else bfloat16)",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help="device memory budget, e.g. 16GiB: exit 1 when M_max does not fit",
    )
    p.add_argument("--backend", choices=["cpu", "gpu"], help="MLX device (default: MLX's default)")
    p.add_argument("--alignment", type=int, default=64, help="arena alignment in bytes (64)")
    p.add_argument(
        "--pack-seconds",
        type=float,
        default=1.0,
        metavar="S",
        help=(
            "search budget of the offset packer when its greedy pass misses the lower bound, "
            "spread over the phases; a fixed amount of work, so plans stay reproducible "
            "(default 1; 0: greedy only)"
        ),
    )
    p.add_argument("--profile", choices=PROFILE_NAMES, help="roofline target profile")
    p.add_argument(
        "--sync-every",
        type=int,
        default=0,
        metavar="LAYERS",
        help="also sync after every LAYERS decoder layers (default 0: phase end only)",
    )
    p.add_argument(
        "--hash-weights",
        action="store_true",
        help="record the sha256 of every safetensors file (reads all weights once)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--progress", action="store_true", help="progress on stderr even when it is not a terminal"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The compiler (mlx.nn, numpy, mlx-lm) is imported here, not at parse time, so other
    # subcommands -- `dctms run` above all -- never load it.
    from dctms.schema.io import encode_plan, write_plan
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.model_source import load_source

    start = time.perf_counter()

    show = not args.quiet and (args.progress or sys.stderr.isatty())

    def progress(msg: str) -> None:
        if show:
            print(f"[{time.perf_counter() - start:6.2f}s] {msg}", file=sys.stderr)

    source = load_source(args.model)
    opts = CompileOptions(
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        batch=args.batch,
        prefill_chunk=args.prefill_chunk,
        dtype=args.dtype,
        device_memory=parse_size(args.memory) if args.memory is not None else None,
        backend=args.backend,
        alignment=args.alignment,
        profile=args.profile,
        hash_weights=args.hash_weights,
        sync_every=args.sync_every,
        pack_seconds=args.pack_seconds,
    )
    plan = compile_plan(source, opts, progress)
    if args.output and args.output != "-":
        write_plan(plan, args.output)
        progress(f"wrote {args.output}")
    else:
        sys.stdout.buffer.write(encode_plan(plan))
    env = plan.envelope
    progress(
        f"M_max {human(env.total)} (weights {human(env.weights)}, kv {human(env.kv)}, "
        f"intermediate {human(env.intermediate)}, runtime {human(env.runtime)})"
    )
    if env.free is not None and env.free < 0:
        print(
            f"dctms compile: M_max {human(env.total)} does not fit the {human(env.device)} budget: "
            f"short by {human(-env.free)} ({-env.free} bytes)",
            file=sys.stderr,
        )
        return 1
    return 0
