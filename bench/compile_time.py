"""Compile-time benchmark: where `dctms compile` spends its time, cold and warm, per step.

Usage: .venv/bin/python bench/compile_time.py [CONFIG ...] [-N 2048] [-M 256] [--warm 1]

For each config (default: the checked-in ones, plans/configs) it starts a fresh interpreter that
imports the compiler (timed), compiles once (cold: mlx-lm's model classes and every in-process
cache loaded for the first time) and then --warm more times in the same process (warm; the
compiler keeps no cache on disk, so a new `dctms compile` always pays the cold figure). Each
compile is split into the compiler's steps, measured by wrapping the passes' functions:

  trace      pass 1: build the model with lazy weights, trace each phase at its bound (and 1c/1d)
  lengths    pass 1b: the traces at smaller lengths, the affine fit, and the re-run of pass 3 at
             every candidate length point (``toolkit.lengths.verified_points``)
  lifetimes  passes 2-3 at the bound: schedule and lifetimes
  pack       pass 4: buffers and offsets (the packer's search budget included)
  verify     the independent verifier (``self_check``)
  emit       the phases' and the plan's records, and encoding the plan to bytes
  other      the rest (weights fingerprint, envelope, ...)

It also times the whole `dctms compile` command in a fresh process (interpreter start and
imports included) and checks that the plan it writes is byte-identical to the in-process one.
The length points are checked by DCTMS_COMPILE_JOBS forked workers (default: every core, Linux).
Times are wall-clock seconds; the load average is printed, since a shared machine inflates them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("trace", "lengths", "lifetimes", "pack", "verify", "emit", "other")


def _measure(config: str, n: int, m: int, warm: int) -> dict:
    """In this (fresh) process: import time, then per-step times of 1 + ``warm`` compiles."""
    t0 = time.perf_counter()
    from dctms.schema.io import encode_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit import caches, compiler
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    imports = time.perf_counter() - t0
    spent: dict[str, float] = {}

    def timed(module, name: str, key: str) -> None:
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

        setattr(module, name, wrapper)

    timed(compiler, "trace_source", "trace_all")
    for name in ("_fit_prefill", "_fit_decode"):
        timed(compiler, name, "fits")
    timed(caches, "fit_start", "fits")
    timed(compiler, "verified_points", "points")
    timed(compiler, "build_schedule", "lifetimes")
    timed(compiler, "analyse", "lifetimes")
    timed(compiler, "assign_arena", "pack")
    timed(compiler, "self_check", "verify")
    for name in ("emit_phase", "emit_lengths", "emit_plan", "attach_modules"):
        timed(compiler, name, "emit")

    runs = []
    for _ in range(1 + warm):
        spent.clear()
        start = time.perf_counter()
        plan = compile_plan(open_model(config), CompileOptions(n, m))
        t = time.perf_counter()
        data = encode_plan(plan)
        spent["emit"] = spent.get("emit", 0.0) + time.perf_counter() - t
        total = time.perf_counter() - start
        steps = {
            "trace": spent.get("trace_all", 0.0) - spent.get("fits", 0.0),
            "lengths": spent.get("fits", 0.0) + spent.get("points", 0.0),
            "lifetimes": spent.get("lifetimes", 0.0),
            "pack": spent.get("pack", 0.0),
            "verify": spent.get("verify", 0.0),
            "emit": spent.get("emit", 0.0),
        }
        steps["other"] = total - sum(steps.values())
        runs.append({"total": total, "steps": steps, "sha256": hashlib.sha256(data).hexdigest()})
    return {"imports": imports, "runs": runs}


def _cli_time(config: str, n: int, m: int, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", config, "-N", str(n), "-M", str(m)]
        + ["-o", str(out), "-q"],
        check=True,
    )
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="config.json files (default: plans/configs/*)")
    ap.add_argument("-N", type=int, default=2048)
    ap.add_argument("-M", type=int, default=256)
    ap.add_argument("--warm", type=int, default=1, help="warm compiles after the cold one")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_measure(args.one, args.N, args.M, args.warm)))
        return
    configs = args.configs or [str(p) for p in sorted((ROOT / "plans/configs").glob("*.json"))]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; wall seconds")
    print(
        f"{'config':<34}{'run':<6}{'total':>7}{'imports':>8}" + "".join(f"{s:>10}" for s in STEPS)
    )
    for config in configs:
        out = subprocess.run(
            [sys.executable, __file__, "--one", config, "-N", str(args.N), "-M", str(args.M)]
            + ["--warm", str(args.warm)],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        name = Path(config).stem
        for k, run in enumerate(result["runs"]):
            label = "cold" if k == 0 else "warm"
            imports = f"{result['imports']:>8.2f}" if k == 0 else f"{'':>8}"
            print(
                f"{name:<34}{label:<6}{run['total']:>7.2f}{imports}"
                + "".join(f"{run['steps'][s]:>10.2f}" for s in STEPS)
            )
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "plan"
            cli = _cli_time(config, args.N, args.M, plan)
            digest = hashlib.sha256(plan.read_bytes()).hexdigest()
        same = {digest} == {run["sha256"] for run in result["runs"]}
        print(
            f"{name:<34}`dctms compile` in a fresh process: {cli:.2f} s; "
            f"plans {'identical' if same else 'DIFFER'} across runs"
        )


if __name__ == "__main__":
    main()
