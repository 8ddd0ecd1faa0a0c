"""What one call costs: a batched plan's decode step at 1-B rows and its prefill chunk at several
lengths, against mlx-lm's model forward at the same shapes (each in its own process, same BLAS).

    .venv/bin/python bench/step_costs.py [--model DIR] [-N 256] [-M 64] [--batch 8]
        [--position 90] [--repeats 20] [--json FILE]

This is the cost model behind the serving benchmark (bench/serve_vs_mlx_lm.py): a server's
throughput is the rows it advances per call over what a call costs. For each row count r the plan's
decode step runs r sequences at position ``--position`` (the median of ``--repeats`` calls,
after three warm-up calls); mlx-lm's model runs a ``[r, 1]`` step over a KV cache of the same
length. For each prompt length T the plan's prefill chunk of T tokens runs at that position, and
mlx-lm's model a ``[1, T]`` forward. The weight floor is one pass over the model's weights by
matmuls of one row: what no call can go below on this machine (the matmuls stream every weight
from memory once). dctms's process preloads OpenBLAS itself; mlx-lm's gets the same LD_PRELOAD.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8)
TOKENS = (16, 32, 64)


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def dctms_costs(plan_path: str, model: str, position: int, repeats: int, rows: list[int]) -> dict:
    """Milliseconds per call of the plan's decode step (per row count) and prefill (per T)."""
    import time

    import mlx.core as mx

    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.schema.model_folder import open_model_folder

    plan = load_checked_plan(Path(plan_path))
    s = BatchSession(plan, open_model_folder(model))
    s.prerecord()

    def timed(run) -> float:
        for _ in range(3):
            run()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
        return _median(samples) * 1000

    out: dict = {"decode_ms": {}, "prefill_ms": {}}
    for r in rows:
        program = s.decode_one if r == 1 and s.decode_one else s.decode
        point = program.lengths.pick({"rows": r, "window": position + 1})
        feeds = {
            "tokens": mx.array([5] * r, dtype=mx.uint32),
            "positions": mx.array([position] * r, dtype=mx.int32),
        }
        out["decode_ms"][r] = timed(
            lambda p=program, f=feeds, pt=point: p.run(f, s.weights, s.state, point=pt)[
                "next_token"
            ].tolist()
        )
    for t in TOKENS:
        point = s.prefill.lengths.pick({"tokens": t, "window": position + t})
        feeds = {
            "tokens": mx.ones((1, t), dtype=mx.int32),
            "position": mx.array(position, dtype=mx.int32),
            "last_index": mx.array(t - 1, dtype=mx.int32),
            "slot": mx.array(0, dtype=mx.int32),
        }
        out["prefill_ms"][t] = timed(
            lambda f=feeds, pt=point: s.prefill.run(f, s.weights, s.state, point=pt)[
                "next_token"
            ].item()
        )
    return out


def mlx_lm_costs(model: str, position: int, repeats: int, rows: list[int]) -> dict:
    """The same calls through mlx-lm's model and KV cache; and the one-row weight floor."""
    import time

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    net, _ = load(model)

    def cache_at(batch: int):
        cache = make_prompt_cache(net)
        mx.eval(net(mx.ones((batch, position), dtype=mx.int32), cache=cache))
        mx.eval([c.state for c in cache])
        return cache

    def timed(run, reset) -> float:
        samples = []
        for k in range(3 + repeats):
            state = reset()
            t0 = time.perf_counter()
            run(state)
            if k >= 3:
                samples.append(time.perf_counter() - t0)
        return _median(samples) * 1000

    out: dict = {"decode_ms": {}, "prefill_ms": {}}
    for r in rows:
        cache = cache_at(r)
        step = mx.ones((r, 1), dtype=mx.int32)

        def decode(c, step=step):
            mx.argmax(net(step, cache=c)[:, -1], axis=-1).tolist()
            for layer in c:  # stay at the same length: the step's entry is dropped again
                layer.offset -= 1

        out["decode_ms"][r] = timed(decode, lambda c=cache: c)
    for t in TOKENS:
        piece = mx.ones((1, t), dtype=mx.int32)

        def prefill(c, piece=piece):
            mx.argmax(net(piece, cache=c)[:, -1], axis=-1).item()

        out["prefill_ms"][t] = timed(prefill, lambda: cache_at(1))
    # the floor: every weight matrix of the model once, by a one-row matmul each
    weights = [w for _, w in _leaves(net.parameters()) if w.ndim == 2]
    x = {w.shape[1]: mx.ones((1, w.shape[1])) for w in weights}
    out["weights_bytes"] = sum(w.nbytes for w in weights)
    out["weight_floor_ms"] = timed(
        lambda _: mx.eval([x[w.shape[1]] @ w.T for w in weights]), lambda: None
    )
    return out


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for k, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _in_child(system: str, args, plan: Path, rows: list[int]) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_vs_mlx_lm import server_env

    argv = [sys.executable, __file__, "--child", system, "--model", str(args.model),
            "--plan", str(plan), "--position", str(args.position),
            "--repeats", str(args.repeats), "--rows", ",".join(map(str, rows))]  # fmt: skip
    done = subprocess.run(argv, env=server_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(d: dict, m: dict) -> list[str]:
    lines = ["| call | dctms (ms) | mlx-lm (ms) | ratio |", "|---|---:|---:|---:|"]
    for r in d["decode_ms"]:
        a, b = d["decode_ms"][r], m["decode_ms"][r]
        lines.append(f"| decode step, {r} row{'s' if int(r) > 1 else ''} | {a:.1f} | {b:.1f} "
                     f"| {a / b:.2f} |")  # fmt: skip
    for t in d["prefill_ms"]:
        a, b = d["prefill_ms"][t], m["prefill_ms"][t]
        lines.append(f"| prefill, {t} tokens | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    lines.append(f"| weight floor: {m['weights_bytes'] / 2**20:,.0f} MiB of weight matrices, "
                 f"one row each | | {m['weight_floor_ms']:.1f} | |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model folder (default: SmolLM2 as dctms demo has it)")
    ap.add_argument("-N", type=int, default=256)
    ap.add_argument("-M", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--position", type=int, default=90)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["dctms", "mlx_lm"], help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rows = [int(r) for r in args.rows.split(",")]
        run = dctms_costs if args.child == "dctms" else mlx_lm_costs
        extra = (args.plan,) if args.child == "dctms" else ()
        print(json.dumps(run(*extra, str(args.model), args.position, args.repeats, rows)))
        return 0
    from batched_plan import compile_batched, model_or_demo

    args.model = model_or_demo(args.model)
    rows = [r for r in ROWS if r <= args.batch] + ([args.batch] if args.batch not in ROWS else [])
    with tempfile.TemporaryDirectory() as tmp:
        plan = compile_batched(args.model, args.N, args.M, args.batch, Path(tmp, "b.plan"))
        d = _in_child("dctms", args, plan, rows)
        m = _in_child("mlx_lm", args, plan, rows)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    import os

    print(f"bench/step_costs.py: {args.model.name}, plan N = {args.N}, M = {args.M}, "
          f"B = {args.batch}, at position {args.position}; median of {args.repeats} calls; "
          f"{platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {stamp}")  # fmt: skip
    print("\n".join(table(d, m)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dctms": d, "mlx_lm": m, "date": stamp}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
