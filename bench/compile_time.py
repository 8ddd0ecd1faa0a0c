"""Compile-time benchmark: where `dctms compile` spends its time, cold and warm, per step.

Usage: .venv/bin/python bench/compile_time.py [CONFIG ...] [-N 2048] [-M 256] [--warm 1]
       [--fit 8GiB]

For each config (default: the checked-in ones, plans/configs) it starts a fresh interpreter that
imports the compiler (timed), compiles once (cold: mlx-lm's model classes and every in-process
cache loaded for the first time) and then --warm more times in the same process (warm). These runs
pack every phase (the packing cache, ``toolkit.pack.memo``, is off for them). Each
compile is split into the compiler's steps, measured by wrapping the passes' functions:

  trace      pass 1: build the model with lazy weights, trace each phase at its bound (and 1c/1d)
  lengths    pass 1b: the traces at smaller lengths, the affine fit, and the check of pass 3's
             decisions at every candidate length point (``toolkit.lengths.verified_points``:
             replayed by ``toolkit.same_lives``, pass 3 itself where the replay proves nothing)
  lifetimes  passes 2-3 at the bound: schedule and lifetimes
  pack       pass 4: buffers and offsets (the packer's search budget included)
  verify     the independent verifier (``self_check``)
  emit       the phases' and the plan's records, and encoding the plan to bytes
  other      the rest (weights fingerprint, envelope, ...)

It also times the whole `dctms compile` command in a fresh process (interpreter start and
imports included) and checks that the plan it writes is byte-identical to the in-process one; then
twice more over an empty packing cache of its own, and prints the second (the phases read from
the cache, as a repeated `dctms compile`, `check` or `fit` of the same config finds them).
With ``--fit MEMORY`` it also times ``dctms fit CONFIG --memory MEMORY -M <M> --search chunk`` in a
fresh process (its compiles are probes without length points, ``cli/commands/fit.py``).
Length points left to pass 3 are spread over DCTMS_COMPILE_JOBS forked workers (opt-in, Linux).
Times are seconds of wall clock and of CPU (this process's threads and its finished workers), and
the load average is printed: on a shared machine the wall clock is inflated, the CPU much less so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("trace", "lengths", "lifetimes", "pack", "verify", "emit", "other")


def _clocks() -> tuple[float, float]:
    """(wall, CPU) seconds; CPU counts this process's threads and its finished workers."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time() + children.ru_utime + children.ru_stime


def _measure(config: str, n: int, m: int, warm: int) -> dict:
    """In this (fresh) process: import time, then per-step times of 1 + ``warm`` compiles."""
    start = _clocks()
    from dctms.schema.io import encode_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit import caches, compiler
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    imports = [b - a for a, b in zip(start, _clocks(), strict=True)]
    spent: dict[str, list[float]] = {}

    def add(key: str, since: tuple[float, float]) -> None:
        now = _clocks()
        got = spent.setdefault(key, [0.0, 0.0])
        for k in range(2):
            got[k] += now[k] - since[k]

    def timed(module, name: str, key: str) -> None:
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            since = _clocks()
            try:
                return inner(*args, **kwargs)
            finally:
                add(key, since)

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
        since = _clocks()
        plan = compile_plan(open_model(config), CompileOptions(n, m))
        t = _clocks()
        data = encode_plan(plan)
        add("emit", t)
        add("total", since)
        runs.append({"sha256": hashlib.sha256(data).hexdigest()})
        for k, clock in enumerate(("wall", "cpu")):

            def get(key: str, k: int = k) -> float:
                return spent.get(key, [0.0, 0.0])[k]

            steps = {
                "trace": get("trace_all") - get("fits"),
                "lengths": get("fits") + get("points"),
                "lifetimes": get("lifetimes"),
                "pack": get("pack"),
                "verify": get("verify"),
                "emit": get("emit"),
            }
            steps["other"] = get("total") - sum(steps.values())
            runs[-1][clock] = {"total": get("total"), "imports": imports[k], "steps": steps}
    return {"runs": runs}


def _cli_time(config: str, n: int, m: int, out: Path, cache: str = "off") -> tuple[float, float]:
    start = _clocks()
    subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", config, "-N", str(n), "-M", str(m)]
        + ["-o", str(out), "-q"],
        check=True,
        env={**os.environ, "DCTMS_PACK_CACHE": cache},
    )
    end = _clocks()
    return end[0] - start[0], end[1] - start[1]


def _fit_time(config: str, m: int, memory: str) -> tuple[float, float, int]:
    start = _clocks()
    out = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "fit", config, "--memory", memory, "-M", str(m)]
        + ["--search", "chunk", "--json", "-q"],
        check=True,
        capture_output=True,
        text=True,
    )
    end = _clocks()
    compiles = json.loads(out.stdout)["best"]["compiles"]
    return end[0] - start[0], end[1] - start[1], compiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="config.json files (default: plans/configs/*)")
    ap.add_argument("-N", type=int, default=2048)
    ap.add_argument("-M", type=int, default=256)
    ap.add_argument("--warm", type=int, default=1, help="warm compiles after the cold one")
    ap.add_argument("--fit", metavar="MEMORY", help="also time `dctms fit --search chunk`")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure in this process
    args = ap.parse_args()
    os.environ["DCTMS_PACK_CACHE"] = "off"  # the steps' figures pack (the children inherit it)
    if args.one:
        print(json.dumps(_measure(args.one, args.N, args.M, args.warm)))
        return
    configs = args.configs or [str(p) for p in sorted((ROOT / "plans/configs").glob("*.json"))]
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; seconds, wall and CPU "
        f"(this process and its workers; on a busy machine wall >> CPU); "
        f"workers: DCTMS_COMPILE_JOBS={os.environ.get('DCTMS_COMPILE_JOBS', '1 (default)')}"
    )
    print(
        f"{'config':<28}{'run':<10}{'total':>7}{'imports':>8}" + "".join(f"{s:>10}" for s in STEPS)
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
        name = Path(config).stem[:27]
        for k, run in enumerate(result["runs"]):
            for clock in ("wall", "cpu"):
                r = run[clock]
                label = f"{'cold' if k == 0 else 'warm'} {clock}"
                imports = f"{r['imports']:>8.2f}" if k == 0 else f"{'':>8}"
                print(
                    f"{name:<28}{label:<10}{r['total']:>7.2f}{imports}"
                    + "".join(f"{r['steps'][s]:>10.2f}" for s in STEPS)
                )
        with tempfile.TemporaryDirectory() as tmp:
            plan = Path(tmp) / "plan"
            wall, cpu = _cli_time(config, args.N, args.M, plan)
            digest = hashlib.sha256(plan.read_bytes()).hexdigest()
            cache = str(Path(tmp) / "packings")
            _cli_time(config, args.N, args.M, plan, cache)
            cached_wall, cached_cpu = _cli_time(config, args.N, args.M, plan, cache)
            same_cached = hashlib.sha256(plan.read_bytes()).hexdigest() == digest
        same = {digest} == {run["sha256"] for run in result["runs"]} and same_cached
        print(
            f"{name:<28}`dctms compile` in a fresh process: {wall:.2f} s wall, {cpu:.2f} s CPU; "
            f"again with its packings cached: {cached_wall:.2f} s wall, {cached_cpu:.2f} s CPU; "
            f"plans {'identical' if same else 'DIFFER'} across runs"
        )
        if args.fit:
            wall, cpu, compiles = _fit_time(config, args.M, args.fit)
            print(
                f"{name:<28}`dctms fit --memory {args.fit} -M {args.M} --search chunk` in a fresh "
                f"process: {wall:.2f} s wall, {cpu:.2f} s CPU, {compiles} compiles"
            )


if __name__ == "__main__":
    main()
