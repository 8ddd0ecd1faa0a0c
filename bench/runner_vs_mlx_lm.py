"""Runner vs mlx-lm on a 21M-parameter random-weight model: a thin entry over ``dctms bench``.

    .venv/bin/python bench/runner_vs_mlx_lm.py [--reps 5] [--max-tokens 32] [-N 2048] [--out DIR]
                                               [--hidden 512 --layers 6 --vocab 8192]

Builds (once, cached under ~/.cache/dctms) a qwen2 model with random weights written as mlx-lm's
convert would (default hidden 512, 6 layers, vocab 8192, float32, no tokenizer: the prompts become
fixed token ids), compiles its plan (N = -N, M = --max-tokens, default chunk), then runs the one A/B
harness, ``dctms bench`` (``dctms.benchmark``: interleaved calls in one process, P1-P5, bootstrap
ratios, the parity table with each system's roofline fraction) with ``--ignore-eos``. Everything
after "compile" is exactly what ``dctms bench PLAN --model DIR`` prints and writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dctms.schema.cache_home import cache_dir


def model_config(hidden: int, layers: int, vocab: int) -> dict:
    heads = max(1, hidden // 64)
    return {
        "model_type": "qwen2",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 11 // 4,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": vocab - 1,
    }


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The model folder (built when missing or of another config) and its compiled plan."""
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    config = model_config(args.hidden, args.layers, args.vocab)
    folder = args.dir or cache_dir() / f"bench-qwen2-h{args.hidden}-l{args.layers}-v{args.vocab}"
    try:
        current = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        current = None
    if current != config or not (folder / "model.safetensors").is_file():
        print(f"building the random-weight model in {folder}", file=sys.stderr)
        write_tiny_model(folder, config, seed=0, tokenizer=False)
    plan = compile_plan(open_model(folder), CompileOptions(args.N, args.max_tokens))
    plan_path = folder / f"n{args.N}-m{args.max_tokens}.plan"
    write_plan(plan, plan_path)
    return folder, plan_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="repetitions per prompt (default 5)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per call, also M (default 32)")
    p.add_argument("-N", type=int, default=2048, help="prompt bound (default 2048: P5 fits)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dir", type=Path, help="model folder (default: under ~/.cache/dctms)")
    p.add_argument("--out", default="bench-out/runner-vs-mlx-lm", help="dctms bench --out")
    p.add_argument("--prompts", help="dctms bench --prompts (default P1-P5)")
    args, rest = p.parse_known_args(argv)
    folder, plan_path = prepare(args)
    from dctms.cli.main import main as dctms

    bench = ["bench", str(plan_path), "--model", str(folder), "--reps", str(args.reps)]
    bench += ["--max-tokens", str(args.max_tokens), "--out", args.out, "--ignore-eos"]
    if args.prompts:
        bench += ["--prompts", args.prompts]
    return dctms(bench + rest)


if __name__ == "__main__":
    from dctms.runner.blas import reexec_with_fast_blas

    reexec_with_fast_blas()  # both systems on OpenBLAS when MLX carries the reference BLAS
    sys.exit(main())
