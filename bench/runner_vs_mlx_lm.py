"""Runner vs mlx-lm: decode throughput and latency stability, interleaved A/B in one process.

    .venv/bin/python bench/runner_vs_mlx_lm.py [--rounds 10] [--tokens 128] [--prompt-tokens 64]

Builds (once, cached) a small random-weight qwen2 model (default hidden 512, 6 layers, vocab 8192,
float32: ~21M parameters) written as mlx-lm convert would, compiles its plan (N = prompt tokens,
M = tokens), then alternates, round by round, mlx-lm's greedy ``generate_step`` and the runner's
``Session.generate`` on the same prompt and token count (the order flips every round, so neither
always runs second). One warm-up generation of each is not measured.

Measured per generation (decode only; the first token, i.e. prefill/TTFT, is reported apart):
* mlx-lm: the time between consecutive tokens yielded by ``generate_step`` (it pipelines: the next
  step's graph is built and dispatched before the current token is read);
* runner: ``Generation.token_latencies_s``, the wall time of each decode step (one plan execution
  and reading its token).
Printed: decode tok/s = decode tokens / summed decode time (pooled over rounds), the ratio runner ÷
mlx-lm (goal >= 1.0); CV_L = sigma / mu of the *per-token* decode latency pooled over all rounds
(headline, goal: runner ÷ mlx-lm <= 0.5), and also of the per-generation decode time; P50/P99;
each system's own MLX peak (the process peak minus the arrays the other system holds). MLX's
limits are MLX's defaults during mlx-lm rounds and the plan's during runner rounds (memory limit
raised by the mlx-lm weights this process also holds). Numbers are printed as measured; goals are
not enforced. Raw numbers are written to ``bench/results/runner_vs_mlx_lm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dctms"


def model_config(args: argparse.Namespace) -> dict:
    heads = max(1, args.hidden // 64)
    return {
        "model_type": "qwen2",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.hidden * 11 // 4,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "vocab_size": args.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": args.vocab - 1,
    }


def prepare(args: argparse.Namespace) -> tuple[Path, Path, dict]:
    from dctms.schema.io import write_plan
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.model_source import load_source
    from dctms.toolkit.tiny_model import write_tiny_model

    config = model_config(args)
    name = f"bench-qwen2-h{args.hidden}-l{args.layers}-v{args.vocab}"
    folder = args.dir or cache_dir() / name
    try:
        current = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        current = None
    if current != config or not (folder / "model.safetensors").is_file():
        print(f"building {name} in {folder}", file=sys.stderr)
        write_tiny_model(folder, config, seed=0, tokenizer=False)
    plan = compile_plan(
        load_source(folder),
        CompileOptions(
            input_tokens=args.prompt_tokens,
            output_tokens=args.tokens,
            sync_every=args.sync_every,
        ),
    )
    plan_path = folder / f"n{args.prompt_tokens}-m{args.tokens}.plan"
    write_plan(plan, plan_path)
    return folder, plan_path, config


def stats(values: list[float]) -> dict:
    mu = statistics.fmean(values)
    sigma = statistics.pstdev(values) if len(values) > 1 else 0.0
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]

    return {
        "n": len(values),
        "mean_s": mu,
        "std_s": sigma,
        "cv": sigma / mu if mu else 0.0,
        "p50_s": pct(0.50),
        "p99_s": pct(0.99),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="A/B rounds (default 10)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per generation (M)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (N)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dir", type=Path, help="model folder (default: ~/.cache/dctms/bench-...)")
    p.add_argument(
        "--sync-every", type=int, default=0, help="decoder layers per plan segment (0: phase end)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=ROOT / "bench" / "results" / "runner_vs_mlx_lm.json",
        help="where to write the raw numbers",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2 or args.prompt_tokens < 1:
        p.error("need --rounds >= 1, --tokens >= 2, --prompt-tokens >= 1")

    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from dctms.runner.load import load_checked_plan, open_model_folder
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session

    folder, plan_path, config = prepare(args)
    default_memory = mx.get_memory_limit()
    default_cache = mx.set_cache_limit(0)
    mx.set_cache_limit(default_cache)

    model, _ = load_model(folder)
    mx.eval(model.parameters())
    params = sum(v.size for v in _leaves(model.parameters()))
    mlx_lm_held = sum(v.nbytes for v in _leaves(model.parameters()))
    session = Session(load_checked_plan(plan_path), open_model_folder(folder))
    runner_held = (
        sum(v.nbytes for v in session.weights.values())
        + sum(v.nbytes for v in session.state.values())
        + sum(
            v.nbytes for prog in (session.prefill, session.decode) for v in prog.constants.values()
        )
    )
    prompt = [(i * 7919 + 13) % args.vocab for i in range(args.prompt_tokens)]
    k = args.tokens
    request = validate_request(session.plan, prompt, k)

    def greedy(x: mx.array) -> mx.array:
        return mx.argmax(x, axis=-1)

    def run_mlx_lm() -> dict:
        mx.set_memory_limit(default_memory)
        mx.set_cache_limit(default_cache)
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        tokens, stamps = [], []
        start = time.perf_counter()
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=k, sampler=greedy):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
        lat = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return {
            "tokens": tokens,
            "ttft_s": stamps[0] - start,
            "decode_latencies_s": lat,
            "peak": mx.get_peak_memory(),
            "peak_above_start": mx.get_peak_memory() - before,
            "own_peak": mx.get_peak_memory() - runner_held,
        }

    def run_runner() -> dict:
        # The runner's own limits (as `dctms run` sets them), except that the memory limit also
        # covers what mlx-lm holds in this process: MLX's eval pauses the host once active memory
        # exceeds the limit, which would throttle the runner for a foreign reason.
        mx.clear_cache()
        foreign = max(0, mx.get_active_memory() - session.held_bytes())
        session.apply_limits(foreign)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        gen = session.generate(request)
        return {
            "tokens": gen.tokens,
            "ttft_s": gen.ttft_s,
            "decode_latencies_s": gen.token_latencies_s,
            "peak": mx.get_peak_memory(),
            "peak_above_start": mx.get_peak_memory() - before,
            "own_peak": mx.get_peak_memory() - foreign,
        }

    systems = {"mlx_lm": run_mlx_lm, "runner": run_runner}
    for fn in systems.values():  # warm-up, not measured
        fn()
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.rounds):
        order = ["mlx_lm", "runner"] if r % 2 == 0 else ["runner", "mlx_lm"]
        for name in order:
            rounds[name].append(systems[name]())
    mx.set_memory_limit(default_memory)
    mx.set_cache_limit(default_cache)

    summary: dict[str, dict] = {}
    for name, runs in rounds.items():
        per_token = [x for run in runs for x in run["decode_latencies_s"]]
        per_call = [sum(run["decode_latencies_s"]) for run in runs]
        summary[name] = {
            "decode_tok_s": len(per_token) / sum(per_token),
            "per_token": stats(per_token),
            "per_call": stats(per_call),
            "ttft": stats([run["ttft_s"] for run in runs]),
            "process_mlx_peak_bytes": max(run["peak"] for run in runs),
            "own_mlx_peak_bytes": max(run["own_peak"] for run in runs),
            "peak_above_start_bytes": max(run["peak_above_start"] for run in runs),
        }
    a, b = summary["runner"], summary["mlx_lm"]
    same = all(
        x["tokens"] == y["tokens"] for x, y in zip(rounds["runner"], rounds["mlx_lm"], strict=True)
    )
    ratios = {
        "tok_s_runner_over_mlx_lm": a["decode_tok_s"] / b["decode_tok_s"],
        "cv_per_token_runner_over_mlx_lm": _div(a["per_token"]["cv"], b["per_token"]["cv"]),
        "cv_per_call_runner_over_mlx_lm": _div(a["per_call"]["cv"], b["per_call"]["cv"]),
        "own_mlx_peak_runner_over_mlx_lm": a["own_mlx_peak_bytes"] / b["own_mlx_peak_bytes"],
    }

    env = session.plan.envelope
    print(
        f"model: qwen2 hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"vocab {config['vocab_size']}, float32, {params / 1e6:.1f}M parameters ({folder})"
    )
    print(
        f"protocol: {args.rounds} interleaved A/B rounds (order flips each round), prompt "
        f"{len(prompt)} tokens, {k} generated ({k - 1} decode steps each), greedy, 1 warm-up each; "
        f"MLX {mx.__version__} on {mx.default_device()}"
    )
    print(f"outputs identical in every round: {'yes' if same else 'NO'}")
    print()
    print(f"{'':28}{'runner':>14}{'mlx-lm':>14}{'runner/mlx-lm':>16}")
    rows = [
        ("decode tok/s", a["decode_tok_s"], b["decode_tok_s"], "{:14.1f}"),
        ("per-token mean (ms)", a["per_token"]["mean_s"] * 1e3, b["per_token"]["mean_s"] * 1e3, "{:14.3f}"),
        ("per-token sigma (ms)", a["per_token"]["std_s"] * 1e3, b["per_token"]["std_s"] * 1e3, "{:14.3f}"),
        ("per-token P50 (ms)", a["per_token"]["p50_s"] * 1e3, b["per_token"]["p50_s"] * 1e3, "{:14.3f}"),
        ("per-token P99 (ms)", a["per_token"]["p99_s"] * 1e3, b["per_token"]["p99_s"] * 1e3, "{:14.3f}"),
        ("CV_L per token", a["per_token"]["cv"], b["per_token"]["cv"], "{:14.4f}"),
        ("CV per generation", a["per_call"]["cv"], b["per_call"]["cv"], "{:14.4f}"),
        ("TTFT mean (ms)", a["ttft"]["mean_s"] * 1e3, b["ttft"]["mean_s"] * 1e3, "{:14.2f}"),
        ("own MLX peak (MiB)", a["own_mlx_peak_bytes"] / 2**20, b["own_mlx_peak_bytes"] / 2**20, "{:14.2f}"),
        ("peak above start (MiB)", a["peak_above_start_bytes"] / 2**20, b["peak_above_start_bytes"] / 2**20, "{:14.3f}"),
    ]  # fmt: skip
    for label, x, y, fmt in rows:
        ratio = f"{x / y:16.3f}" if y else f"{'n/a':>16}"
        print(f"{label:28}{fmt.format(x)}{fmt.format(y)}{ratio}")
    print()
    print(
        f"tok/s runner / mlx-lm = {ratios['tok_s_runner_over_mlx_lm']:.3f} (goal >= 1.0: "
        f"{'met' if ratios['tok_s_runner_over_mlx_lm'] >= 1.0 else 'NOT met'})"
    )
    cv = ratios["cv_per_token_runner_over_mlx_lm"]
    print(
        f"CV_L (per-token decode latency) runner / mlx-lm = {_fmt(cv)} (goal <= 0.5: "
        f"{'met' if cv is not None and cv <= 0.5 else 'NOT met'}); "
        f"per-generation CV ratio {_fmt(ratios['cv_per_call_runner_over_mlx_lm'])}"
    )
    print(
        f"own MLX peak = process peak minus the other system's held arrays ({mlx_lm_held:,} B of "
        f"mlx-lm weights; {runner_held:,} B of runner weights, cache, constants); runner own peak "
        f"{a['own_mlx_peak_bytes']:,} B vs provable M_max {env.provable:,} B "
        f"(provable / observed {env.provable / a['own_mlx_peak_bytes']:.3f})"
    )

    result = {
        "config": config,
        "parameters": params,
        "args": {k_: str(v) if isinstance(v, Path) else v for k_, v in vars(args).items()},
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "outputs_identical": same,
        "summary": summary,
        "ratios": ratios,
        "provable_bytes": env.provable,
        "raw": {
            name: [
                {k_: v for k_, v in run.items() if k_ != "tokens"} | {"tokens": run["tokens"]}
                for run in runs
            ]
            for name, runs in rounds.items()
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"raw numbers: {args.json}")
    return 0


def _leaves(tree):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


def _div(x: float, y: float) -> float | None:
    return x / y if y else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    from dctms.runner.blas import reexec_with_fast_blas

    reexec_with_fast_blas()  # both systems on OpenBLAS when MLX carries the reference BLAS
    sys.exit(main())
