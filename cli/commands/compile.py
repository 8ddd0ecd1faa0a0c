"""``dctms compile MODEL -N INT -M INT [-o PLAN]``: trace a model and write its memory plan."""

from __future__ import annotations

import argparse
import sys
import time

from dctms.cli.compile_options import add_compile_options, compile_options
from dctms.figures.units import human
from dctms.schema.errors import DctmsError

DEFAULT_NUM_DRAFT = 3  # as mlx_lm.generate --num-draft-tokens


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
    add_compile_options(p, memory_required=False)
    vision = p.add_argument_group("vision-language models (mlx-vlm folders)")
    vision.add_argument(
        "--images", type=int, metavar="K", help="most images per call (plans the vision tower)"
    )
    vision.add_argument(
        "--image-size",
        metavar="HxW",
        help="largest image after the model's own preprocessing (e.g. 224x224)",
    )
    p.add_argument(
        "--draft",
        metavar="DRAFT",
        help="speculative decoding: also plan this draft model (folder or config.json; same "
        "vocabulary) and the target's verify phase",
    )
    p.add_argument(
        "--num-draft",
        type=int,
        metavar="K",
        help=f"tokens the draft proposes per verify call (default {DEFAULT_NUM_DRAFT}; needs --draft)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--progress", action="store_true", help="progress on stderr even when it is not a terminal"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.cli.inputs import model_inputs
    from dctms.schema.output import reserve_output

    if not args.output or args.output == "-":
        if args.output == "":
            raise DctmsError("-o '': empty path (use - for stdout)")
        return _run(args, None)
    # Checked (and the file reserved) before any work: never onto the model, a device or a folder.
    inputs = model_inputs(args.model) + (model_inputs(args.draft) if args.draft else [])
    with reserve_output(args.output, inputs=inputs, label=f"-o {args.output}") as target:
        return _run(args, target)


def _run(args: argparse.Namespace, target) -> int:
    # The compiler (mlx.nn, numpy, mlx-lm) is imported here, not at parse time, so other
    # subcommands -- `dctms run` above all -- never load it.
    import dataclasses

    import dctms
    from dctms.schema.io import encode_plan

    start = time.perf_counter()

    show = not args.quiet and (args.progress or sys.stderr.isatty())

    def progress(msg: str) -> None:
        if show:
            print(f"[{time.perf_counter() - start:6.2f}s] {msg}", file=sys.stderr)

    opts = compile_options(args, args.input_tokens, args.output_tokens)
    # Built on the Python API: every compile option is one of dctms.compile_plan's keywords.
    keywords = dataclasses.asdict(opts)
    keywords["memory"] = keywords.pop("device_memory")
    if args.num_draft is not None and not args.draft:
        raise DctmsError("--num-draft needs --draft DRAFT (the draft model)")
    if args.images is not None or args.image_size is not None:
        plan = _compile_vision(args, opts, progress)
    elif args.draft:
        from dctms.schema.model_folder import open_model
        from dctms.toolkit.speculative import compile_speculative

        k = DEFAULT_NUM_DRAFT if args.num_draft is None else args.num_draft
        plan = compile_speculative(
            open_model(args.model), open_model(args.draft), opts, k, progress
        )
    else:
        plan = dctms.compile_plan(args.model, progress=progress, **keywords)
    if target is not None:
        target.write(encode_plan(plan))
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


def _compile_vision(args: argparse.Namespace, opts, progress):
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.vision_compile import VisionOptions, compile_vlm_plan, parse_image_size

    if args.images is None or args.image_size is None:
        raise DctmsError("vision-language plans need both --images K and --image-size HxW")
    height, width = parse_image_size(args.image_size)
    return compile_vlm_plan(
        open_model(args.model), opts, VisionOptions(args.images, height, width), progress
    )
