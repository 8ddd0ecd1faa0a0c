"""``dctms compile MODEL -N INT -M INT [-o PLAN]``: trace a model and write its memory plan."""

from __future__ import annotations

import argparse
import sys

from dctms.cli.compile_options import add_compile_options, add_plan_kind_options, compile_options
from dctms.cli.hf_cache import add_download_flag, with_hub
from dctms.cli.progress import progress_printer
from dctms.figures.budget import shortfall
from dctms.figures.units import human
from dctms.schema.errors import DctmsError


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
    p.add_argument(
        "model",
        metavar="MODEL",
        help="model folder, config.json, or Hugging Face id ORG/NAME[@REVISION] (cached)",
    )
    p.add_argument("-N", "--input-tokens", type=int, required=True, help="longest prompt (tokens)")
    p.add_argument("-M", "--output-tokens", type=int, required=True, help="most generated tokens")
    p.add_argument(
        "-o",
        "--output",
        metavar="PLAN",
        help="plan file to write (required; - for stdout); with --ranks, a folder for rank<r>.plan",
    )
    add_compile_options(p, memory_required=False)
    add_plan_kind_options(p)
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress and no summary on stderr"
    )
    p.add_argument(
        "--progress", action="store_true", help="progress on stderr even when it is not a terminal"
    )
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.cli.inputs import model_inputs
    from dctms.schema.output import reserve_output

    if args.ranks > 1 or args.parallel is not None:  # -o FOLDER, checked there
        from dctms.cli.distributed import compile_ranks_command

        return compile_ranks_command(args)
    if args.output is None:  # a plan is megabytes of JSON: never onto a terminal by default
        raise DctmsError("give -o PLAN (the plan file to write; -o - writes it to stdout)")
    if args.output == "":
        raise DctmsError("-o '': empty path (use - for stdout)")
    if args.output == "-":
        return _run(args, None)
    # Checked (and the file reserved) before any work: never onto the model, a device or a folder.
    inputs = model_inputs(args.model) + (model_inputs(args.draft) if args.draft else [])
    with reserve_output(args.output, inputs=inputs, label=f"-o {args.output}") as target:
        return _run(args, target)


def _run(args: argparse.Namespace, target) -> int:
    # The compiler (mlx.nn, numpy, mlx-lm) is imported here, not at parse time, so other
    # subcommands -- `dctms run` above all -- never load it.
    from dctms.cli.compile_options import plan_kind
    from dctms.schema.io import encode_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.kinds.dispatch import compile_kind

    progress = progress_printer(args)
    opts = compile_options(args, args.input_tokens, args.output_tokens)
    plan = compile_kind(open_model(args.model), opts, plan_kind(args), progress)
    plan = with_hub(plan, getattr(args, "hub", {}).get("model"))
    if shortfall(plan.envelope) and plan.bounds.prefix_blocks > 0:
        # bad input, like --batch 0: nothing is written (reserve_output removes the reservation)
        raise DctmsError(pool_over_budget(plan))
    if plan.bounds.batch > 1 and shortfall(plan.envelope):
        raise DctmsError(batch_over_budget(plan))
    if target is not None:
        target.write(encode_plan(plan))
    else:
        sys.stdout.buffer.write(encode_plan(plan))
        sys.stdout.flush()
    if not args.quiet and plan.target.memory_model is not None:
        from dctms.toolkit.targets import compile_note

        print(f"dctms compile: {compile_note(plan.target.memory_model.name)}", file=sys.stderr)
    if not args.quiet:  # whatever stdout is: the plan's one figure and where it went
        print(summary_line(plan, "the plan to stdout" if target is None else args.output), file=sys.stderr)
    short = shortfall(plan.envelope)
    if short:
        print(f"dctms compile: {short}", file=sys.stderr)
        return 1
    return 0


def pool_over_budget(plan) -> str:
    """A prefix pool beyond the ``--memory`` budget, and the largest that fits (the pool is state
    of its own: the other terms do not depend on it)."""
    env, k = plan.envelope, plan.bounds.prefix_blocks
    pool = sum(s.bytes for s in plan.state if s.name.endswith(".pool"))
    per_block = pool // k
    rest = env.total - pool
    fits = (env.device - rest) // per_block if env.device > rest else 0
    head = (
        f"a prefix pool of {k} blocks ({human(pool)}) makes M_max {human(env.total)} "
        f"({env.total:,} B), beyond the {human(env.device)} ({env.device:,} B) budget"
    )
    if fits < 1:
        return f"{head}; without the pool M_max is {human(rest)}: no block fits"
    return (
        f"{head}; the largest pool that fits is --prefix-blocks {min(fits, k - 1)} "
        f"({human(per_block)} per block)"
    )


def batch_over_budget(plan) -> str:
    """``--batch B`` beyond the ``--memory`` budget, and the largest B that fits. Fewer slots
    shrink the KV state by one slot each and never grow the phases' arenas (a decode step of fewer
    rows is smaller), so the figure keeps this plan's other terms: a plan at that B fits."""
    env, b = plan.envelope, plan.bounds.batch
    per_slot = env.kv // b
    fixed = env.total - env.kv
    fits = (env.device - fixed) // per_slot if per_slot and env.device > fixed else 0
    fits = min(fits, b - 1)
    head = (
        f"--batch {b} needs M_max {human(env.total)} ({env.total:,} B), beyond the "
        f"{human(env.device)} ({env.device:,} B) budget"
    )
    if fits < 1:
        return f"{head}; not even one slot fits (each holds {human(per_slot)} of KV)"
    return (
        f"{head}; the largest batch that fits is --batch {fits} "
        f"(at most {human(fixed + fits * per_slot)}; {human(per_slot)} of KV per slot)"
    )


def summary_line(plan, written: str) -> str:
    """``wrote PLAN: M_max 1.50 GiB (1,610,612,736 B; weights ..., kv ..., ...)``."""
    env = plan.envelope
    return (
        f"wrote {written}: M_max {human(env.total)} ({env.total:,} B; weights {human(env.weights)}, "
        f"kv {human(env.kv)}, intermediate {human(env.intermediate)}, "
        f"runtime {human(env.runtime)})"
    )

