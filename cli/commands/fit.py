"""``dctms fit MODEL --memory 16GiB (-M INT | -N INT) [--search chunk]``: the longest prompt (or
generation) that fits, optionally over candidate prefill chunks.

Exit status: 0 with the fit printed, 1 when even 1 token does not fit (the shortfall is printed),
2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from dctms.cli.compile_options import (
    add_compile_options,
    add_plan_kind_options,
    compile_options,
    memory_budget,
    plan_kind,
)
from dctms.cli.hf_cache import add_download_flag
from dctms.schema.errors import DctmsError

if TYPE_CHECKING:
    from dctms.schema.types import Plan
    from dctms.views.fit import FitResult

DEFAULT_MAX_COMPILES = 400


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit",
        help="largest N (given -M) or M (given -N) whose M_max fits a memory budget",
        description=(
            "Search for the largest number of input tokens N (given -M) or output tokens M (given "
            "-N) whose plan's M_max fits --memory, by real compiles: the largest value first, "
            "then 1, then interpolation between a fitting and a non-fitting value (bisection when "
            "that stalls), ending with the certificate that the answer fits and answer + 1 does "
            "not. One compile answers for every value with the same prefill chunk, KV capacity "
            "and padded prompt (the same plan). N + M stops at the config's "
            "max_position_embeddings (else 2^20). Prints the envelope at the fit. With --search chunk, the search runs for every "
            "candidate prefill chunk (--chunks) and prints chunk -> largest N (or M), M_max, and "
            "the roofline's predicted TTFT and decode tok/s on the target profile, then picks the "
            "chunk that fits the most tokens. All other options are `dctms compile`'s."
        ),
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="model folder, config.json, or Hugging Face id ORG/NAME[@REVISION] (cached)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("-M", "--output-tokens", type=int, help="fixed M: search the largest N")
    which.add_argument("-N", "--input-tokens", type=int, help="fixed N: search the largest M")
    add_compile_options(p, memory_required=True)
    add_plan_kind_options(p)
    p.add_argument(
        "--search",
        choices=["chunk"],
        help="also search over the prefill chunk (the KV cache's format is not searched: "
        "give --kv-bits to fit with a quantised cache)",
    )
    p.add_argument(
        "--chunks",
        metavar="LIST",
        help="candidate prefill chunks for --search chunk, comma-separated "
        "(default 32,64,128,256,512,1024,2048)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="P",
        help="prompt length of the TTFT column of --search chunk (default: the smallest fit)",
    )
    p.add_argument(
        "--max-compiles",
        type=int,
        default=DEFAULT_MAX_COMPILES,
        metavar="K",
        help=f"stop with an error after K compiles in all (default {DEFAULT_MAX_COMPILES})",
    )
    p.add_argument("-o", "--output", metavar="PLAN", help="also write the plan at the fit")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_download_flag(p)
    p.set_defaults(func=run)


def _chunks(args: argparse.Namespace) -> list[int]:
    from dctms.views.fit_chunks import DEFAULT_CHUNKS

    if args.search != "chunk":
        if args.chunks is not None or args.prompt_tokens is not None:
            raise DctmsError("--chunks and --prompt-tokens need --search chunk")
        return [args.prefill_chunk]  # None: the compiler's default
    if args.prefill_chunk is not None:
        raise DctmsError("--prefill-chunk fixes the chunk that --search chunk searches: give one")
    if args.chunks is None:
        return list(DEFAULT_CHUNKS)
    try:
        chunks = sorted({int(c) for c in args.chunks.split(",") if c.strip()})
    except ValueError:
        raise DctmsError(
            f"--chunks: not a comma-separated list of integers: {args.chunks!r}"
        ) from None
    if not chunks or chunks[0] < 1:
        raise DctmsError(f"--chunks: every chunk must be at least 1, got {args.chunks!r}")
    return chunks


def run(args: argparse.Namespace) -> int:
    from dctms.cli.inputs import model_inputs
    from dctms.schema.output import reserve_output

    if args.output is None:
        return _run(args, None)
    # Checked (and the file reserved) before the search: never onto the model, a device or a folder.
    label = f"-o {args.output or repr(args.output)}"
    inputs = model_inputs(args.model) + (model_inputs(args.draft) if args.draft else [])
    with reserve_output(args.output, inputs=inputs, label=label) as target:
        return _run(args, target)


def _write(target, plan, args, source, kind) -> None:
    """The plan at the fit, as ``dctms compile`` would write it (with its real-length points)."""
    if target is not None:
        from dctms.schema.io import encode_plan
        from dctms.toolkit.kinds.dispatch import compile_kind

        b = plan.bounds
        opts = compile_options(
            args, b.input_tokens, b.output_tokens, prefill_chunk=b.prefill_chunk
        )
        target.write(encode_plan(compile_kind(source, opts, kind)))


def _run(args: argparse.Namespace, target) -> int:
    from dctms.figures.units import human
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import length_extent, length_step
    from dctms.toolkit.kinds.dispatch import compile_kind
    from dctms.toolkit.kinds.distributed import widest_rank
    from dctms.toolkit.limits import MAX_TOKENS
    from dctms.views.fit import DEFAULT_CAP, fit_summary, fit_text, largest_fitting, max_positions

    budget = memory_budget(args)
    search_n = args.output_tokens is not None
    fixed = args.output_tokens if search_n else args.input_tokens
    letter, other = ("N", "M") if search_n else ("M", "N")
    if fixed < 1:
        raise DctmsError(f"-{other} must be at least 1, got {fixed}")
    if args.max_compiles < 1:
        raise DctmsError(f"--max-compiles must be at least 1, got {args.max_compiles}")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise DctmsError(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    chunks = _chunks(args)
    if args.ranks > 1 and (args.split == "memory" or target is not None):
        raise DctmsError(
            "fit --ranks: --split memory and -o are for dctms compile --ranks at the fit"
        )
    source = open_model(args.model)
    kind = plan_kind(args)
    if args.ranks > 1 and kind.name != "text":
        raise DctmsError(f"not supported yet: fit --ranks of a {kind.name} plan")
    limit = max_positions(source.config)
    cap = DEFAULT_CAP if limit is None else limit - fixed
    cap_reason = (
        f"{letter} = 2^20" if limit is None else f"max_position_embeddings {limit:,} (N + M)"
    )
    if cap > MAX_TOKENS - fixed:  # a config's absurd limit: the compiler's own comes first
        cap, cap_reason = MAX_TOKENS - fixed, f"the compiler's limit of {MAX_TOKENS:,} (N + M)"
    if cap < 1:
        raise DctmsError(
            f"{other} = {fixed:,} leaves no room: the model's max_position_embeddings is {limit:,}"
        )

    start = time.perf_counter()
    compiles = 0

    def bounds(value: int) -> tuple[int, int]:
        return (value, fixed) if search_n else (fixed, value)

    def search(chunk: int | None, hint, label: str) -> tuple[FitResult, Plan | None]:
        fitting: dict[int, Plan] = {}  # the largest plan that fits, so it is not compiled twice
        base = replace(compile_options(args, *bounds(1), prefill_chunk=chunk), real_lengths=False)

        def measure(value: int) -> int:
            nonlocal compiles
            if compiles >= args.max_compiles:
                raise DctmsError(
                    f"stopped after --max-compiles {args.max_compiles} compiles without a "
                    "certificate: raise it or give fewer --chunks"
                )
            compiles += 1
            n, m = bounds(value)
            # Probes skip the real-length points, the module paths and the verifier (none changes
            # the envelope); the plan written with -o is compiled in full (_write).
            opts = replace(base, input_tokens=n, output_tokens=m)
            plan = ahead.take(opts)  # compiled ahead in a worker process (_Ahead), or None
            if plan is None:
                began = time.perf_counter()
                # --ranks: the budget is per rank, so a probe's M_max is its largest rank's.
                if opts.ranks == 1:
                    plan = compile_kind(source, opts, kind, probe=True)
                else:
                    plan = widest_rank(source, opts, probe=True)
                ahead.compiled(opts, time.perf_counter() - began)
            total = plan.envelope.total
            if total <= budget and value > max(fitting, default=0):
                fitting.clear()
                fitting[value] = plan
            if not args.quiet:
                verdict = "fits" if total <= budget else f"over by {human(total - budget)}"
                first, _ = extent(value) if extent else (value, value)
                alike = f" (as every {letter} from {first:,})" if first < value else ""
                print(
                    f"[{time.perf_counter() - start:6.2f}s] {label}{letter} = {value:,}{alike}: "
                    f"M_max {human(total)}, {verdict}",
                    file=sys.stderr,
                )
            return total

        # A text plan's compile depends on N and M only through its length key: one probe
        # answers for every value with the same key (toolkit.compiler.length_extent).
        extent = length_extent(base, search_n, cap) if kind.name == "text" else None
        step = length_step(base, search_n)
        result = largest_fitting(measure, budget, cap, hint=hint, step=step, extent=extent)
        return result, fitting.get(result.best) if result.best is not None else None

    # --search chunk starts every chunk at the cap: those probes are independent, so worker
    # processes compile them while this one searches (a text plan whose probes are slow enough to
    # pay for the workers' start-up, more than one core).
    probes_ahead = []
    if args.search == "chunk" and kind.name == "text" and args.ranks == 1 and len(chunks) > 1:
        probes_ahead = [
            replace(compile_options(args, *bounds(cap), prefill_chunk=c), real_lengths=False)
            for c in chunks
        ]
    ahead = _Ahead(args.model, probes_ahead)
    if args.search == "chunk":
        with ahead:
            return _run_chunk_search(
                args, search, chunks, letter, other, fixed, budget, start, (cap, cap_reason),
                target, (source, kind),
            )

    result, plan = search(chunks[0], cap, "")  # cap first: when it fits, one compile answers
    elapsed = time.perf_counter() - start
    if result.best is None or plan is None:
        return _nothing_fits(args, result, letter, other, fixed, budget)
    summary = fit_summary(result, plan, "input_tokens" if search_n else "output_tokens", elapsed)
    _write(target, plan, args, source, kind)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        model = f"{plan.model.architecture} ({plan.model.num_layers} layers)"
        sys.stdout.write(fit_text(summary, model, cap_reason))
    return 0


class _Ahead:
    """Probes compiled ahead by up to two worker processes (spawned: MLX is not fork-safe), each
    taken at most once, in its own order, by the search that asks for the same options. The
    workers start only once a probe compiled here took ``AHEAD_MIN_S`` (a worker's start-up,
    importing MLX and the compiler, costs about that: a small model's probes are cheaper done
    here), and compile the probes not yet compiled. A probe that fails in its worker is compiled
    again where the search asks (and fails there, in one line). Nothing runs on one core."""

    AHEAD_MIN_S = 0.5

    def __init__(self, model: str, probes: list):
        self.model, self.probes = model, list(probes)
        self.pool = None
        self.futures: dict = {}

    def __enter__(self) -> _Ahead:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def compiled(self, opts, seconds: float) -> None:
        """A probe compiled here: not to be compiled ahead; start the workers if it was slow."""
        if opts in self.probes:
            self.probes.remove(opts)
        jobs = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        if self.pool is not None or seconds < self.AHEAD_MIN_S or jobs < 2 or not self.probes:
            return
        if not _spawn_can_start_here():
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(
            max_workers=jobs, mp_context=spawn, initializer=_leave_interrupts_to_the_parent
        )
        self.futures = {o: self.pool.submit(_probe_in_worker, self.model, o) for o in self.probes}

    def take(self, opts) -> Plan | None:
        future = self.futures.pop(opts, None)
        if future is None:
            return None
        try:
            data = future.result()
        except Exception:  # a worker that could not start or died: compile it here instead
            return None
        if data is None:
            return None
        import msgspec

        from dctms.schema.types import Plan as PlanType

        return msgspec.msgpack.decode(data, type=PlanType)


def _spawn_can_start_here() -> bool:
    """A spawned worker first re-runs this program's ``__main__``: safe for the ``dctms`` command
    (and pytest), which do nothing when imported; a host script without an ``if __name__ ==
    "__main__"`` guard would run again in every worker, so elsewhere the probes run here."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else os.path.basename(getattr(main, "__file__", "") or "")
    return name in ("dctms", "dctms.cli.main", "pytest", "pytest.__main__", "py.test")


def _leave_interrupts_to_the_parent() -> None:
    """Ctrl-C reaches the whole process group: the search's process answers it (exit 130, one
    line) and shuts the workers down; a worker printing its own traceback would break that."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _probe_in_worker(model: str, opts) -> bytes | None:
    """A text plan's probe in a worker process, as msgpack; None if it fails (the search then
    compiles it itself, and reports the error as it would)."""
    import msgspec

    from dctms.schema.model_folder import open_model
    from dctms.toolkit.kinds.dispatch import compile_kind

    try:
        return msgspec.msgpack.encode(compile_kind(open_model(model), opts, probe=True))
    except Exception:
        return None


def _nothing_fits(args, result, letter: str, other: str, fixed: int, budget: int) -> int:
    from dctms.figures.units import human

    first = result.probe(1)
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


def _run_chunk_search(
    args, search, chunks, letter, other, fixed, budget, start, capped: tuple[int, str], target,
    model,
) -> int:
    source, kind = model
    cap, cap_reason = capped
    from dctms.figures.roofline import prediction_profile
    from dctms.figures.units import human
    from dctms.views.fit import fit_summary, fit_text
    from dctms.views.fit_chunks import best_row, chunk_doc, chunk_row, chunk_table_text

    if not args.quiet:
        print(
            f"searching {len(chunks)} prefill chunks ({', '.join(map(str, chunks))}); "
            f"at most {args.max_compiles} compiles",
            file=sys.stderr,
        )
    found: list[tuple[int, FitResult, Plan | None]] = []
    previous = None
    for i, chunk in enumerate(chunks):
        # first the largest value (when it fits, one compile answers; compiled ahead by the
        # workers), then the previous chunk's answer: the next chunk's is usually close
        hints = [cap] if previous is None else [cap, previous]
        result, plan = search(chunk, hints, f"chunk {chunk} ({i + 1}/{len(chunks)}): ")
        found.append((chunk, result, plan))
        previous = result.best or previous
    fits = [r.best for _, r, _ in found if r.best is not None]
    if not fits:
        return _nothing_fits(args, found[-1][1], letter, other, fixed, budget)
    if letter == "N":
        prompt = args.prompt_tokens or min(fits)
    else:
        prompt = min(args.prompt_tokens or fixed, fixed)
    rows = []
    for chunk, result, plan in found:
        over = None if result.best is None else result.probe(result.best + 1)
        rows.append(
            chunk_row(
                chunk,
                result.best,
                plan,
                None if over is None else over.total,
                len(result.probes),
                prompt,
            )
        )
    best = best_row(rows)
    _, result, plan = next(f for f in found if f[0] == best.chunk)
    elapsed = time.perf_counter() - start
    summary = fit_summary(
        result, plan, "input_tokens" if letter == "N" else "output_tokens", elapsed
    )
    summary["compiles"] = sum(len(r.probes) for _, r, _ in found)
    _write(target, plan, args, source, kind)
    profile = prediction_profile(plan).name  # what views.fit_chunks predicted on
    if args.json:
        doc = {
            "search": "chunk",
            "prompt_tokens": prompt,
            "profile": profile,
            "chunks": chunk_doc(rows),
            "best": summary,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    model = f"{plan.model.architecture} ({plan.model.num_layers} layers)"
    lines = [
        f"{model}, {other} = {fixed:,}, budget {human(budget)}: "
        f"prefill chunk {best.chunk} fits the most, {letter} = {best.value:,}",
        "",
        chunk_table_text(rows, letter, prompt, profile, best).rstrip("\n"),
        "",
        f"the fit at chunk {best.chunk}:",
    ]
    sys.stdout.write("\n".join(lines) + "\n" + fit_text(summary, model, cap_reason))
    return 0
