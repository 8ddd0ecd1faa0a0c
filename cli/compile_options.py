"""The compile options, defined once: ``dctms compile`` and ``dctms fit`` both add them to their
parser with ``add_compile_options`` and read them back with ``compile_options``, so a new compiler
knob reaches both commands (and ``fit`` cannot silently lack one).

Kept free of compiler imports so ``--help`` stays fast; ``compile_options`` imports the compiler's
``CompileOptions`` only when a command runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dctms.figures.units import parse_size
from dctms.schema.draft import DEFAULT_NUM_DRAFT
from dctms.schema.errors import DctmsError

if TYPE_CHECKING:
    from dctms.toolkit.compiler import CompileOptions
    from dctms.toolkit.kinds.dispatch import PlanKind


# Known target profiles, listed here so `--help` needs no compiler import (a test keeps them equal
# to dctms.toolkit.profiles.PROFILES).
PROFILE_NAMES = (
    "apple-m1",
    "apple-m1-max",
    "apple-m1-pro",
    "apple-m4-16gb",
    "apple-m4-max",
    "apple-m4-pro",
    "cpu-x86-2core",
    "cpu-x86-2core-openblas",
    "nvidia-a100-sxm",
    "nvidia-h100-sxm",
    "nvidia-h200-sxm",
)

DTYPE_CHOICES = ("bfloat16", "float16", "float32")


def add_compile_options(parser: argparse.ArgumentParser, *, memory_required: bool) -> None:
    """Every compiler option except the token bounds -N / -M (each command sets those its way)."""
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="slots: sequences in flight at once, each at its own position (default 1)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--prefix-blocks",
        type=int,
        default=0,
        metavar="K",
        help="a prompt-prefix pool of K blocks, each one prefill chunk of every layer's keys and "
        "values, kept across requests (counted in M_KV; least recently used evicted)",
    )
    pool.add_argument(
        "--prefix-cache",
        metavar="SIZE",
        help="a prompt-prefix pool of as many blocks as SIZE holds, e.g. 64MiB",
    )
    parser.add_argument(
        "--prefill-chunk", type=int, help="tokens per prefill call (default min(N, 512))"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="cast every floating weight to this dtype at load (default: the dtypes the weights are "
        "stored in, as mlx-lm runs them; a config alone: its torch_dtype, else bfloat16)",
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE",
        required=memory_required,
        help="device memory budget, e.g. 16GiB"
        + ("" if memory_required else ": exit 1 when M_max does not fit"),
    )
    parser.add_argument(
        "--backend", choices=["cpu", "gpu"], help="MLX device (default: MLX's default)"
    )
    parser.add_argument(
        "--target",
        metavar="TARGET",
        help="memory model: cpu, metal[-PROFILE] or cuda[-PROFILE]; a GPU target is traced on "
        "the CPU on any machine and planned by its allocator as modelled from MLX's source "
        "(not measured; see docs: targets)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="MLX's fused kernels (mx.fast rms_norm, rope, scaled_dot_product_attention) as plan "
        "ops in a CPU plan, each charged with the composite MLX's CPU falls back to (a GPU "
        "target has them always)",
    )
    parser.add_argument("--alignment", type=int, default=64, help="arena alignment in bytes (64)")
    parser.add_argument(
        "--pack-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help=(
            "search budget of the offset packer when its greedy pass misses the lower bound, "
            "spread over the phases; a fixed amount of work, so plans stay reproducible "
            "(default 2; 0: greedy only)"
        ),
    )
    parser.add_argument("--profile", choices=PROFILE_NAMES, help="roofline target profile")
    parser.add_argument(
        "--sync-every",
        type=int,
        default=0,
        metavar="LAYERS",
        help="also sync after every LAYERS decoder layers (default 0: phase end only)",
    )
    parser.add_argument(
        "--run-ahead",
        choices=("free", "throttled"),
        default="free",
        help="how far MLX's host may run ahead of its worker: 'free' (default) plans for MLX's own "
        "bound and needs no throttle; 'throttled' plans a smaller envelope (~3 %%) and has the "
        "runner hold the host back with MLX's memory limit (prefill near the envelope's peak is "
        "slower)",
    )
    kv = parser.add_argument_group("KV cache (mlx-lm's generate_step settings)")
    kv.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="quantise the KV cache to this many bits (mlx-lm's kv_bits; default: not quantised)",
    )
    kv.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        metavar="G",
        help="elements per scale and bias of the quantised cache (32, 64 or 128; default 64)",
    )
    kv.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        metavar="T",
        help="quantise the cache after the call that reaches T tokens; calls before attend in "
        "float (default 0; mlx-lm's own default is 5000)",
    )
    kv.add_argument(
        "--max-kv-size",
        type=int,
        metavar="W",
        help="a rotating cache of W positions keeping the first 4 (mlx-lm's max_kv_size; models "
        "without their own make_cache, as in mlx-lm)",
    )
    parser.add_argument(
        "--token-step",
        type=int,
        metavar="T",
        help="length grid: a prefill chunk runs padded to a multiple of T tokens, growing by about "
        "an eighth beyond 8 steps (default 16)",
    )
    parser.add_argument(
        "--window-step",
        type=int,
        metavar="W",
        help="length grid: decode attends over a window of a multiple of W positions, growing by "
        "about an eighth beyond 8 steps (default 32)",
    )
    parser.add_argument(
        "--sampling",
        action="store_true",
        help="trace mlx-lm's sampler and logits processors (temperature, top-p, top-k, min-p, "
        "repetition penalty, logit bias, seeded draws) and the log-probabilities OpenAI's logprobs "
        "return into the plan, their parameters chosen per request (default: greedy only)",
    )
    parser.add_argument(
        "--hash-weights",
        action="store_true",
        help="record the sha256 of every safetensors file (reads all weights once)",
    )
    dist = parser.add_argument_group("distributed (mlx.distributed ranks; see README Distributed)")
    dist.add_argument(
        "--ranks", type=int, default=1, metavar="R", help="split the model over R ranks (default 1)"
    )
    dist.add_argument(
        "--parallel",
        choices=["pipeline", "tensor"],
        help="how mlx-lm splits it: pipeline(group) (layers) or shard(group) (tensor parallel)",
    )
    dist.add_argument(
        "--split",
        metavar="count|memory|N,N,..",
        help="pipeline: layers per rank by count (mlx-lm's default), the split that minimises the "
        "largest per-rank M_max (memory; compile only), or given per rank (rank 0 runs the last)",
    )


def rank_split(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--split`` as layers per rank; None for count (mlx-lm's default) and memory (searched)."""
    text = getattr(args, "split", None)
    if text is None or text in ("count", "memory"):
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise DctmsError(
            f"--split: expected count, memory or comma-separated layer counts, got {text!r}"
        ) from None


def memory_budget(args: argparse.Namespace) -> int | None:
    """``--memory`` in bytes (None when not given); a bad size is one line naming the option."""
    if args.memory is None:
        return None
    try:
        return parse_size(args.memory)
    except DctmsError as err:
        raise DctmsError(f"--memory: {err}") from None


def prefix_cache_bytes(args: argparse.Namespace) -> int | None:
    """``--prefix-cache`` in bytes (None when not given)."""
    if getattr(args, "prefix_cache", None) is None:
        return None
    try:
        return parse_size(args.prefix_cache)
    except DctmsError as err:
        raise DctmsError(f"--prefix-cache: {err}") from None


def compile_options(
    args: argparse.Namespace,
    input_tokens: int,
    output_tokens: int,
    prefill_chunk: int | None = None,
) -> CompileOptions:
    """The ``CompileOptions`` the parsed options describe, at the given bounds (``prefill_chunk``
    overrides ``--prefill-chunk``: ``fit --search chunk`` compiles at several)."""
    from dctms.toolkit.compiler import CompileOptions

    return CompileOptions(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        batch=args.batch,
        prefix_blocks=args.prefix_blocks,
        prefix_cache=prefix_cache_bytes(args),
        prefill_chunk=prefill_chunk if prefill_chunk is not None else args.prefill_chunk,
        dtype=args.dtype,
        device_memory=memory_budget(args),
        backend=args.backend,
        target=getattr(args, "target", None),
        alignment=args.alignment,
        profile=args.profile,
        hash_weights=args.hash_weights,
        sync_every=args.sync_every,
        run_ahead=args.run_ahead,
        pack_seconds=args.pack_seconds,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        max_kv_size=args.max_kv_size,
        token_step=args.token_step,
        window_step=args.window_step,
        ranks=args.ranks,
        parallel=args.parallel,
        split=rank_split(args),
        sampling=getattr(args, "sampling", False),
        fused=getattr(args, "fused", False),
    )


def add_plan_kind_options(parser: argparse.ArgumentParser) -> None:
    """The options that choose a vision-language or a speculative plan instead of a text one."""
    vision = parser.add_argument_group("vision-language models (mlx-vlm folders)")
    vision.add_argument(
        "--images", type=int, metavar="K", help="most images per call (plans the vision tower)"
    )
    vision.add_argument(
        "--image-size",
        metavar="HxW",
        help="largest image after the model's own preprocessing (e.g. 224x224)",
    )
    vision.add_argument(
        "--overlap",
        action="store_true",
        help="encode images on a second MLX stream while the text before them is prefilled "
        "(M_intermediate covers one call of each stream at once)",
    )
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--draft",
        metavar="DRAFT",
        help="also plan this draft model (folder or config.json; same vocabulary) and the "
        "target's verify phase",
    )
    spec.add_argument(
        "--num-draft",
        type=int,
        metavar="K",
        help=f"tokens the draft proposes per verify call (default {DEFAULT_NUM_DRAFT}; needs --draft)",
    )


def plan_kind(args: argparse.Namespace) -> PlanKind:
    """The plan kind the parsed options ask for; one line naming a missing companion option."""
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.kinds.dispatch import TEXT, Images, PlanKind

    if args.num_draft is not None and not args.draft:
        raise DctmsError("--num-draft needs --draft DRAFT (the draft model)")
    images = None
    if args.overlap and args.images is None:
        raise DctmsError("--overlap is for vision-language plans (with --images and --image-size)")
    if args.images is not None or args.image_size is not None:
        from dctms.toolkit.vision.compiler import parse_image_size

        if args.images is None or args.image_size is None:
            raise DctmsError("vision-language plans need both --images K and --image-size HxW")
        images = Images(args.images, *parse_image_size(args.image_size), overlap=args.overlap)
    if images is None and not args.draft:
        return TEXT
    draft = open_model(args.draft) if args.draft else None
    k = DEFAULT_NUM_DRAFT if args.num_draft is None else args.num_draft
    return PlanKind(images, draft, k)
