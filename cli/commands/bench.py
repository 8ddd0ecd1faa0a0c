"""``dctms bench PLAN --model DIR``: the paper's A/B protocol, plan runner against mlx-lm."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dctms.benchmark.loading import ALTERNATE, LOAD_ORDERS, Loaded
from dctms.cli.hf_cache import add_download_flag

DEFAULT_REPS = 5
DEFAULT_MAX_TOKENS = 32
DEFAULT_OUT = "bench-out"
EXIT_INTERRUPTED = 130


# Which copy of the weights is allocated first (the other comes second).


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark the plan runner against mlx-lm's stock generation (paper §3.6)",
        description=(
            "Run the five prompt categories P1-P5 R times on two systems in one process — mlx-lm's "
            "stock generation (generate_step over mlx_lm.utils.load_model) and the dctms runner "
            "executing PLAN — alternating call by call, greedy. Records wall latency, TTFT, "
            "tokens, peak RSS (10 ms sampler) and MLX peak per call in OUT/calls.json (rewritten "
            "atomically after every call), and writes OUT/summary.md (the paper's Tables 2/3 "
            "layout, per-prompt figures, runner/baseline ratios with bootstrap 95% intervals), "
            "OUT/summary.json and, with matplotlib, OUT/bench.png and OUT/bench.svg. Ctrl-C "
            f"keeps the calls completed so far, writes their summary and exits {EXIT_INTERRUPTED}."
        ),
    )
    p.add_argument("plan", metavar="PLAN")
    p.add_argument(
        "--model", required=True, metavar="DIR", help="model folder the plan was compiled for"
    )
    p.add_argument(
        "--reps",
        type=int,
        default=DEFAULT_REPS,
        metavar="R",
        help=f"repetitions per prompt and system (default {DEFAULT_REPS}; the paper used 50)",
    )
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="prompt file (default: plans/prompts/p1-p5.json of this source tree)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="M",
        help=f"tokens generated per call at most (default {DEFAULT_MAX_TOKENS}, or the plan's M "
        "if smaller; the paper used 256)",
    )
    p.add_argument(
        "--out", metavar="DIR", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="W",
        help="untimed warm-up calls per system on the first prompt before measuring (default 1)",
    )
    p.add_argument(
        "--draft-model",
        metavar="DIR",
        help="speculative plan (compile --draft): compare the runner, the speculative runner and "
        "mlx-lm's speculative_generate_step with the plan's K (OUT/speculative.md)",
    )
    p.add_argument(
        "--load-order",
        choices=LOAD_ORDERS,
        default=ALTERNATE,
        help="which system's weights are loaded first: alternate (default; runner first on odd "
        "repetitions, baseline first on even ones, re-loaded between them), runner-first or "
        "baseline-first; on this machine the second-loaded copy decodes several %% faster",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="send the prompts as raw text even when the tokenizer has a chat template",
    )
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the figures")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    add_download_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.benchmark.prompts import (
        PromptIds,
        byte_token_ids,
        check_bounds,
        default_prompts_file,
        load_prompts,
    )
    from dctms.runner.load import load_checked_plan
    from dctms.schema.errors import DctmsError
    from dctms.schema.model_folder import open_model_folder
    from dctms.schema.output import check_output_folder

    # Before anything is loaded: a folder, or a new path in a writable one.
    check_output_folder(args.out, label=f"--out {args.out or repr(args.out)}")
    if args.reps < 1:
        raise DctmsError(f"--reps must be at least 1, got {args.reps}")
    if args.warmup < 0:
        raise DctmsError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.resamples < 1:
        raise DctmsError(f"--resamples must be at least 1, got {args.resamples}")
    plan = load_checked_plan(args.plan)
    if plan.vision is not None:
        raise DctmsError(
            "a vision-language plan: its benchmark is bench/vlm.py (TTFT overlapped vs serial "
            "vs mlx-vlm); run it with `dctms run PLAN --image FILE`"
        )
    model = open_model_folder(args.model)
    bounds = plan.bounds
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, bounds.output_tokens)

    prompts_path = Path(args.prompts) if args.prompts else default_prompts_file()
    prompts = load_prompts(prompts_path)
    tokenizer = None
    if (model.path / "tokenizer.json").is_file():
        from dctms.runner.tokenize import Tokenizer, encode_chat, eos_ids

        tokenizer = Tokenizer(model.path)
        if tokenizer.has_chat_template and not args.ignore_chat_template:
            # As mlx_lm.generate does: each prompt is one user message through the chat template.
            ids = [PromptIds(p, encode_chat(tokenizer, p.text)) for p in prompts]
            tokenization = (
                f"{model.path / 'tokenizer.json'}: each prompt sent as a user message through the "
                "tokenizer's chat template (with the generation prompt), as mlx_lm.generate does"
            )
        else:
            ids = [PromptIds(p, tokenizer.encode(p.text)) for p in prompts]
            why = "--ignore-chat-template" if args.ignore_chat_template else "no chat template"
            tokenization = f"{model.path / 'tokenizer.json'} (raw text, {why})"
        stop = set() if args.ignore_eos else eos_ids(model.path, tokenizer)
    else:
        vocab = plan.model.vocab_size
        ids = [PromptIds(p, byte_token_ids(p.text, vocab)) for p in prompts]
        tokenization = (
            "no tokenizer.json in the model folder: fixed token-id sequences, each prompt's "
            f"UTF-8 bytes modulo the vocabulary size ({vocab})"
        )
        stop = set()
    from dctms.runner.request import PromptTooLong, validate_requests

    try:
        requests = validate_requests(plan, [p.ids for p in ids], max_tokens, stop)
    except PromptTooLong:
        check_bounds(ids, bounds.input_tokens)  # the same refusal, naming every long prompt
        raise

    from dctms.benchmark.execute import execute
    from dctms.benchmark.progress import ProgressBar
    from dctms.benchmark.protocol import Settings, schedule
    from dctms.benchmark.systems import Baseline, MlxLimits, Runner

    say = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.draft_model:
        return _bench_speculative(args, plan, model, ids, requests, max_tokens, stop, say)
    say("measuring this machine's read bandwidth (for the roofline fraction) ...")
    parity = parity_settings(plan)
    defaults = MlxLimits.capture()  # before the Session sets the plan's limits
    from dctms.runner.session import Session

    recorded = []

    def make_baseline() -> Baseline:
        say("loading the baseline (mlx_lm.utils.load_model) ...")
        return Baseline(model.path, defaults)

    def make_runner() -> Runner:
        say(f"loading the runner (plan {args.plan}, weights {model.path}) ...")
        session = Session(plan, model)
        say("recording the runner's graphs for every length point the prompts use ...")
        recorded.append(session.prerecord(requests))
        return Runner(session, requests)

    loaded = Loaded(make_baseline, make_runner, args.load_order)
    loaded.before_rep(0)

    settings = Settings(reps=args.reps, max_tokens=max_tokens, warmup=args.warmup, stop=stop)
    described = describe_settings(args, plan, model, prompts_path, tokenization, stop, max_tokens)
    described["parity"] = parity
    described["process"] += "; " + loaded.describe()
    described["runner_setup"] = (
        f"the graphs of the {recorded[0].points} length points these calls use recorded before "
        f"the first call in {recorded[0].seconds:.2f} s (set-up, in no call's latency"
        + (", again at each re-load)" if args.load_order == ALTERNATE else ")")
        + f"; weights: {loaded.systems[1].session.weight_allocation.describe()}"
    )
    out_dir = Path(args.out)
    total = len(schedule(len(ids), args.reps))
    bar = ProgressBar(total, enabled=not args.quiet)
    outcome, summary, note = execute(
        loaded.systems,
        ids,
        settings,
        out_dir,
        described,
        resamples=args.resamples,
        seed=args.seed,
        progress=bar,
        figures=not args.no_plot,
        before_rep=loaded.before_rep,
    )
    if note and not args.no_plot:
        print(f"dctms bench: {note}", file=sys.stderr)
    print(headline(summary))
    written = ["calls.json", "summary.md", "summary.json"]
    if not note:
        written += ["bench.png", "bench.svg"]
    print(f"\nwrote {', '.join(written)} to {out_dir}")
    if outcome.interrupted:
        print(
            f"dctms bench: interrupted after {len(outcome.calls)} of {outcome.planned} calls; "
            f"partial results in {out_dir}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0


def _bench_speculative(args, plan, model, ids, requests, max_tokens, stop, say) -> int:
    from dctms.benchmark.progress import ProgressBar
    from dctms.benchmark.protocol import Settings, schedule
    from dctms.benchmark.speculative import SUMMARY_MD, bench_speculative, render
    from dctms.schema.errors import DctmsError
    from dctms.schema.model_folder import open_model_folder

    if plan.draft is None:
        raise DctmsError("--draft-model: the plan has no draft model; compile it with --draft")
    draft = open_model_folder(args.draft_model)
    settings = Settings(reps=args.reps, max_tokens=max_tokens, warmup=args.warmup, stop=stop)
    out_dir = Path(args.out)
    bar = ProgressBar(len(schedule(len(ids), args.reps, 3)), enabled=not args.quiet)
    described = {
        "plan": str(args.plan),
        "model": str(model.path),
        "draft_model": str(draft.path),
        "num_draft": plan.draft.num_draft,
        "reps": args.reps,
        "max_tokens": max_tokens,
        "decoding": "greedy on every system",
        "order": "per repetition, per prompt: runner, speculative runner, mlx-lm speculative",
    }
    outcome, summary = bench_speculative(
        plan, model, draft, ids, requests, settings, out_dir, described, say, bar
    )
    print(render(summary))
    print(f"wrote calls.json, {SUMMARY_MD}, speculative.json to {out_dir}")
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    return 0


def parity_settings(plan) -> dict:
    """What the parity table needs (``dctms.benchmark.parity``): the read bandwidth measured now,
    before either model is loaded (its 256 MiB array is freed and MLX's cache cleared after), the
    bytes a decode token reads, the provable envelope and the runner's decode windows."""
    import mlx.core as mx

    from dctms.benchmark.machine import READ_BYTES, READ_METHOD, REPEATS, measure_read_bandwidth
    from dctms.figures.cache_layout import cache_layout

    bandwidth = measure_read_bandwidth()
    mx.clear_cache()
    env, b = plan.envelope, plan.bounds
    layout = cache_layout(plan)
    decode = next(p for p in plan.phases if p.name == "decode")
    windows = [p[0] for p in decode.lengths.points] if decode.lengths else [b.kv_capacity]
    return {
        "read_bandwidth_bytes_per_s": bandwidth,
        "read_bandwidth_source": f"best of {REPEATS} of {READ_METHOD} over "
        f"{READ_BYTES // 2**20} MiB",
        "weights_bytes": env.weights,
        # Full-capacity layers grow with the positions attended; rings and recurrent state are
        # read whole at every step (dctms.figures.cache_layout).
        "kv_bytes_per_position": layout.bytes_per_position,
        "kv_fixed_bytes": layout.fixed_bytes,
        "provable_bytes": env.provable,
        "decode_windows": sorted(windows),
    }


def describe_settings(
    args: argparse.Namespace,
    plan,
    model,
    prompts_path: Path,
    tokenization: str,
    stop: set[int],
    max_tokens: int,
) -> dict:
    import os
    import platform

    import mlx.core as mx
    import psutil

    import dctms
    from dctms.runner.blas import SWITCH, loaded_blas

    try:
        from importlib.metadata import version

        mlx_lm_version = version("mlx-lm")
    except Exception:  # metadata missing in unusual installs
        mlx_lm_version = "unknown"
    from dctms.runner.session import throttle_limit

    b = plan.bounds
    env = plan.envelope
    limit = throttle_limit(plan)
    # a free run-ahead plan needs no throttle: the limit is the envelope itself
    limit_rule = "" if limit == env.provable else " less the largest single-op allocation"
    cache = (  # as Session.apply_limits sets it
        f"MLX buffer cache {env.intermediate:,} B"
        if plan.target.allocator_slack
        else "MLX buffer cache off (the plan counts no allocator slack)"
    )
    return {
        "plan": str(args.plan),
        "model": str(model.path),
        "bounds": f"N = {b.input_tokens}, M = {b.output_tokens}, prefill chunk {b.prefill_chunk}, "
        f"{b.dtype}, backend {plan.target.backend}",
        "reps": args.reps,
        "max_tokens": max_tokens,
        "warmup": args.warmup,
        "prompts_file": str(prompts_path),
        "decoding": "greedy (argmax) on both systems",
        "stop": (
            f"at end-of-sequence ids {sorted(stop)} on both systems"
            if stop
            else "none: every call generates max tokens"
            + (" (--ignore-eos)" if args.ignore_eos else " (no end-of-sequence id known)")
        ),
        "tokenization": tokenization + "; identical ids for both systems",
        "order": "per repetition, per prompt: baseline then runner (the systems alternate call "
        "by call)",
        "baseline": f"mlx_lm.generate.generate_step (mlx-lm {mlx_lm_version}) over "
        "mlx_lm.utils.load_model, its own growing KV cache; MLX's default memory/cache limits "
        "re-applied before each call",
        "runner": f"dctms Session.generate (static KV cache for {b.kv_capacity} positions); the "
        f"plan's limits re-applied before each call (memory {limit:,} B = provable "
        f"M_max {env.provable:,} B{limit_rule}, plus what the baseline holds; {cache}; "
        f"run-ahead {plan.target.run_ahead_dispatches} dispatches)",
        "process": "one process: the baseline model and the runner's weights are both loaded "
        "(two copies of the weights) for every call of either system",
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, MLX device {mx.default_device()}",
        "blas": f"{loaded_blas().describe()}, shared by both systems (one process); "
        f"{SWITCH}={os.environ.get(SWITCH, 'auto')}",
        "versions": f"python {platform.python_version()}, mlx {mx.__version__}, "
        f"mlx-lm {mlx_lm_version}, dctms {dctms.__version__}",
    }


def headline(summary: dict) -> str:
    """The Tables 2/3 block of ``summary.md`` for the terminal."""
    from dctms.benchmark.report import render_markdown

    text = render_markdown(summary)
    start = text.index("## All prompts")
    end = text.index("## Per prompt")
    return text[start:end].rstrip()
