"""Greedy ids of a batched run against the same prompts run alone (issue #29, item 2).

A batched decode step multiplies B rows at once, so its BLAS calls may sum in another order than a
batch-1 step's: a near-tie between the top two logits can then flip. This counts it: every prompt
runs through a B-slot plan together with the others (``runner.batch``) and alone through a batch-1
plan of the same model and lengths (``runner.session``); for each disagreement it prints the first
differing position and, from mlx-lm's own model on the alone sequence's prefix, the margin between
the two largest logits there.

    python bench/batch_agreement.py MODEL_DIR [--batch 8] [--prompts 64] [-N 256] [-M 32]

Prompts: chat-templated questions of mixed lengths built from plans/prompts/p1-p5.json (each of
the five prompts cut to a different number of words, at most N tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mixed_prompts(count: int, encode, limit: int) -> list[list[int]]:
    """``count`` chat prompts of mixed lengths, each at most ``limit`` tokens: the five paper
    prompts cut at varying word counts (fewer words where the cut would not fit)."""
    data = json.loads((ROOT / "plans/prompts/p1-p5.json").read_text())
    texts = [p["text"] for p in data["prompts"]]
    out = []
    for i in range(count):
        words = texts[i % len(texts)].split()
        keep = max(3, len(words) * (1 + (i * 7) % 10) // 10)
        while True:
            ids = encode(f"({i}) " + " ".join(words[:keep]))
            if len(ids) <= limit or keep <= 1:
                break
            keep = keep * 3 // 4
        out.append(ids)
    return out


def compile_plan(model: str, n: int, m: int, batch: int, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", model, "-N", str(n), "-M", str(m),
         "--batch", str(batch), "-o", str(out), "-q"],
        check=True,
    )  # fmt: skip


def top2_margin(model_dir: str, ids: list[int]) -> float:
    """The top-1 minus top-2 logit of mlx-lm's model after ``ids`` (float32, no cache tricks)."""
    import mlx.core as mx
    from mlx_lm import load

    if not hasattr(top2_margin, "model"):
        top2_margin.model = load(model_dir)[0]
    logits = top2_margin.model(mx.array([ids]))[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return float(top[1] - top[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("-N", type=int, default=256)
    ap.add_argument("-M", type=int, default=32)
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)

    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.session import Session
    from dctms.runner.tokenize import Tokenizer, encode_chat
    from dctms.schema.model_folder import open_model_folder

    folder = open_model_folder(args.model)
    tok = Tokenizer(folder.path)
    prompts = mixed_prompts(args.prompts, lambda text: encode_chat(tok, text, None), args.N)
    with tempfile.TemporaryDirectory() as tmp:
        batched_path, alone_path = Path(tmp, "b.plan"), Path(tmp, "one.plan")
        compile_plan(args.model, args.N, args.M, args.batch, batched_path)
        compile_plan(args.model, args.N, args.M, 1, alone_path)
        batched_plan, alone_plan = load_checked_plan(batched_path), load_checked_plan(alone_path)
    # no stop ids: every sequence runs its M tokens, so every position is compared
    session = BatchSession(batched_plan, folder)
    session.prerecord()
    t0 = time.perf_counter()
    seqs = [session.submit(validate_request(batched_plan, p, args.M)) for p in prompts]
    session.run_all()
    batched_s = time.perf_counter() - t0
    batched_peak = session.observed_peak()
    del session
    single = Session(alone_plan, folder)
    single.prerecord()
    t0 = time.perf_counter()
    alone = [single.generate(validate_request(alone_plan, p, args.M)).tokens for p in prompts]
    alone_s = time.perf_counter() - t0
    del single
    differ = []
    for i, (p, a, s) in enumerate(zip(prompts, alone, seqs, strict=True)):
        b = s.generation.tokens
        if a != b:
            k = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            margin = top2_margin(args.model, list(p) + a[:k])
            differ.append({"prompt": i, "prompt_tokens": len(p), "position": k, "margin": margin})
    lengths = sorted(len(p) for p in prompts)
    figures = {
        "prompts": len(prompts),
        "batch": args.batch,
        "N": args.N,
        "M": args.M,
        "prompt_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "agree": len(prompts) - len(differ),
        "agreement_rate": (len(prompts) - len(differ)) / len(prompts),
        "disagreements": differ,
        "batched_s": round(batched_s, 2),
        "alone_s": round(alone_s, 2),
        "batched_observed_peak": batched_peak,
        "batched_provable": batched_plan.envelope.provable,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
