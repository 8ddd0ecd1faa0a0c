"""`dctms serve` against mlx_lm.server, one after the other on the same model folder, both on
OpenBLAS, with the same streamed greedy chat load at several client counts (loopback only).

    .venv/bin/python bench/serve_vs_mlx_lm.py [--model DIR] [-N 256] [-M 64] [--batch 8]
        [--levels 1,4,8,16] [--requests 32] [--max-tokens 64] [--decode-concurrency 8]
        [--under-limit] [--prefix-blocks K --prefill-chunk C]

The model defaults to SmolLM2-135M-Instruct as `dctms demo` prepares it (fetched once from PyPI and
converted). A plan is compiled for it at -N/-M with ``--batch`` slots (continuous batching;
1: a batch-1 plan, one request at a time). Each server is started in turn (mlx_lm.server with
``--decode-concurrency`` and ``--prompt-concurrency`` set to the same figure, its defaults
otherwise; `dctms serve` with ``--prerecord``, which records every verified length point's graphs
at start rather than on first use, and its own LD_PRELOAD of OpenBLAS), warmed up with one
request, then driven
at each level by that many client threads sharing ``--requests`` streamed chat completions of
``--max-tokens`` tokens (temperature 0; a level with more clients than ``--requests`` sends one
request per client). Reported per level and server: aggregate completion
tokens/s, TTFT and latency P50/P95, the server process's peak RSS (polled every 50 ms); for dctms
also, polled from /metrics every 100 ms, its plan's M_max and provable peak, MLX's observed peak
(the server's, and the batched model's per step) and the most slots busy at once; for both, the
prompt tokens the server says it took from a prompt cache (mlx_lm.server keeps one by default; a
dctms plan has one when ``--prefix-blocks`` compiles it in, its blocks ``--prefill-chunk`` tokens
long). The table
gives the ratios dctms / mlx_lm.server of one run. ``--under-limit`` then
runs each server inside a memory cgroup whose hard limit is `dctms resources`' figure for the plan
and reports what happens (answered requests, OOM kills, the limit's failure count; not asserted).
Written to ``--json`` (default ``bench/results/serve_vs_mlx_lm.json``) and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in a few sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Summarise the plot of a detective story in which the butler did not do it.",
    "How do I boil an egg?",
    "Give me a name for a grey cat.",
    "What is the difference between weather and climate? Answer briefly, for a child.",
]


def server_command(system: str, plan: Path, folder: Path, port: int, concurrency: int) -> list[str]:
    if system == "dctms":
        return [sys.executable, "-m", "dctms.cli.main", "serve", "--plan", f"demo={plan}={folder}",
                "--port", str(port), "--max-queue", "1024", "--prerecord"]  # fmt: skip
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port),
            "--decode-concurrency", str(concurrency), "--prompt-concurrency", str(concurrency),
            "--log-level", "WARNING"]  # fmt: skip


def server_env() -> dict[str, str]:
    """Both servers on the same BLAS: `dctms serve` preloads OpenBLAS itself (dctms.runner.blas);
    mlx_lm.server gets the same LD_PRELOAD here."""
    from dctms.runner.blas import planned_preload

    env = dict(os.environ)
    preload = planned_preload()
    if preload:
        env["LD_PRELOAD"] = preload
    return env


def tree_rss(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def dctms_metrics(url: str, model: str = "demo") -> dict[str, float]:
    """/metrics as {series: value}: the server-wide gauges by name, the model's without its
    ``{model="..."}`` label."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, label = key.partition("{")
        if not label or label == f'model="{model}"}}':
            out[name] = float(value)
    return out


def measure_system(system: str, args, plan: Path, folder: Path, group=None) -> dict:
    from dctms.benchmark.serve_clients import (
        PeakPoller,
        free_port,
        level_figures,
        run_level,
        stop_server,
        stream_chat,
        wait_ready,
    )

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = "demo" if system == "dctms" else "default_model"
    proc = subprocess.Popen(
        server_command(system, plan, folder, port, args.decode_concurrency),
        env=server_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, preexec_fn=group.join if group else None,
    )  # fmt: skip
    out: dict = {"system": system, "levels": []}
    try:
        wait_ready(url, proc)
        stream_chat(url, model, PROMPTS[0], args.max_tokens, 600)  # warm-up
        for clients in args.levels:
            with PeakPoller(lambda: tree_rss(proc.pid)) as rss, PeakPoller(
                (lambda: dctms_metrics(url)) if system == "dctms" else (lambda: None), 0.1
            ) as status:
                answers, wall = run_level(  # every client asks at least once
                    url, model, PROMPTS, max(args.requests, clients), clients, args.max_tokens
                )
            level = dict(level_figures(answers, wall), clients=clients)
            level["peak_rss"] = max(rss.values, default=None)
            polls = [s for s in status.values if s]
            if polls:
                level["polls"] = len(polls)
                level["m_max_provable"] = polls[-1]["dctms_envelope_provable_bytes"]
                level["m_max_total"] = polls[-1]["dctms_envelope_total_bytes"]
                level["plan_m_max"] = polls[-1].get("dctms_model_m_max_bytes")
                level["slots"] = polls[-1].get("dctms_model_slots")
                level["max_slots_busy"] = max(s.get("dctms_model_slots_busy", 0) for s in polls)
                level["observed_peak"] = max(s["dctms_observed_mlx_peak_bytes"] for s in polls)
                level["model_observed_peak"] = max(
                    (s.get("dctms_model_observed_mlx_peak_bytes", 0) for s in polls), default=0
                )
                level["polls_over_provable"] = sum(
                    s["dctms_observed_mlx_peak_bytes"] > s["dctms_envelope_provable_bytes"]
                    for s in polls
                )
            out["levels"].append(level)
            print(f"{system:>7} {clients:>3} clients: {level['tok_per_s']:.2f} tok/s, "
                  f"{level['answered']}/{level['requests']} answered", file=sys.stderr)  # fmt: skip
    except RuntimeError as err:
        out["error"] = str(err)
    finally:
        stop_server(proc)
        out["exit"] = proc.returncode
        out["stderr_tail"] = (proc.stderr.read() if proc.stderr else "")[-600:]
    return out


def under_limit(system: str, args, plan: Path, folder: Path, limit: int) -> dict:
    from dctms.benchmark.cgroup import CgroupUnavailable, create_group, remove_group

    try:
        group = create_group(limit)
    except CgroupUnavailable as err:
        return {"system": system, "skipped": str(err)}
    try:
        run = measure_system(system, args, plan, folder, group)
        return {
            "system": system, "limit": limit, "levels": run["levels"], "exit": run["exit"],
            "error": run.get("error"), "failcnt": group.failcnt, "oom_kills": group.oom_kills,
            "group_peak": group.peak,
        }  # fmt: skip
    finally:
        remove_group(group)


def f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(runs: dict[str, dict]) -> list[str]:
    from dctms.benchmark.serve_clients import cached_of

    a, b = runs["dctms"], runs["mlx_lm"]
    rows = [
        "| clients | dctms tok/s | mlx_lm.server tok/s | ratio | TTFT P50 dctms / mlx_lm (s) "
        "| latency P50 / P95 dctms (s) | latency P50 / P95 mlx_lm (s) | P95 ratio "
        "| peak RSS dctms / mlx_lm (MiB) | dctms observed / provable / M_max (MiB) "
        "| slots busy (max) | prompt tokens from a cache, of all: dctms / mlx_lm |",
        "|---|---:|---:|---:|---|---|---|---:|---|---|---|---|",
    ]
    for la, lb in zip(a["levels"], b["levels"], strict=False):
        ratio = la["tok_per_s"] / lb["tok_per_s"] if lb["tok_per_s"] else None
        p95 = (la["latency_p95_s"] / lb["latency_p95_s"]
               if la["latency_p95_s"] and lb["latency_p95_s"] else None)  # fmt: skip
        mib = 2**20
        rows.append(
            f"| {la['clients']} | {f(la['tok_per_s'])} | {f(lb['tok_per_s'])} | {f(ratio, 3)} "
            f"| {f(la['ttft_p50_s'])} / {f(lb['ttft_p50_s'])} "
            f"| {f(la['latency_p50_s'])} / {f(la['latency_p95_s'])} "
            f"| {f(lb['latency_p50_s'])} / {f(lb['latency_p95_s'])} | {f(p95, 3)} "
            f"| {f((la['peak_rss'] or 0) / mib, 0)} / {f((lb['peak_rss'] or 0) / mib, 0)} "
            f"| {f(la.get('observed_peak', 0) / mib, 1)} / {f(la.get('m_max_provable', 0) / mib, 1)}"
            f" / {f(la.get('m_max_total', 0) / mib, 1)} "
            f"| {f(la.get('max_slots_busy'), 0)} of {f(la.get('slots'), 0)} "
            f"| {cached_of(la)} / {cached_of(lb)} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model folder (default: SmolLM2 as dctms demo has it)")
    p.add_argument("-N", type=int, default=256)
    p.add_argument("-M", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="dctms's plan's slots (default 8)")
    p.add_argument("--levels", default="1,4,8,16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-concurrency", type=int, default=8)
    p.add_argument("--under-limit", action="store_true")
    p.add_argument(
        "--prefix-blocks", type=int, default=0,
        help="give dctms's plan a prompt-prefix pool of this many blocks (mlx_lm.server keeps its "
        "prompt cache on by default); 0: none",
    )  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, help="dctms's prefill chunk (the pool's block)")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve_vs_mlx_lm.json")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    from batched_plan import compile_batched, model_or_demo

    folder = model_or_demo(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--prefix-blocks", str(args.prefix_blocks)] if args.prefix_blocks else []
        extra += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
        plan = compile_batched(folder, args.N, args.M, args.batch, Path(tmp) / "serve.plan", *extra)
        runs = {s: measure_system(s, args, plan, folder) for s in ("dctms", "mlx_lm")}
        limits = {}
        if args.under_limit:
            res = subprocess.run(
                [sys.executable, "-m", "dctms.cli.main", "resources", f"demo={plan}",
                 "--format", "json"], capture_output=True, text=True, check=True,
            )  # fmt: skip
            limit = json.loads(res.stdout)["limit_bytes"]
            limits = {s: under_limit(s, args, plan, folder, limit) for s in ("dctms", "mlx_lm")}
    info = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": folder.name, "N": args.N, "M": args.M, "batch": args.batch,
        "prefix_blocks": args.prefix_blocks, "prefill_chunk": args.prefill_chunk,
        "requests_per_level": args.requests,
        "max_tokens": args.max_tokens, "decode_concurrency": args.decode_concurrency,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"info": info, "runs": runs, "under_limit": limits}, indent=2))
    print(f"{info['command']} — {info['date']}, {info['machine']}, {info['model']}, "
          f"N = {args.N}, M = {args.M}, B = {args.batch} against --decode-concurrency "
          f"{args.decode_concurrency}, {args.requests} requests of {args.max_tokens} tokens per level")
    if all("levels" in r and r["levels"] for r in runs.values()):
        print("\n".join(table(runs)))
    for system, r in limits.items():
        print(f"under a {r.get('limit', 0):,}-byte cgroup limit, {system}: " + (
            r["skipped"] if "skipped" in r else
            f"{sum(lv['answered'] for lv in r['levels'])} of "
            f"{sum(lv['requests'] for lv in r['levels'])} answered, exit {r['exit']}, "
            f"OOM kills {r['oom_kills']}, failcnt {r['failcnt']}"
            + (f", {r['error']}" if r.get("error") else "")))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
