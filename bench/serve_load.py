"""Load on `dctms serve`: many requests from concurrent openai clients, on loopback only.

    .venv/bin/python bench/serve_load.py [--requests 200] [--clients 8] [--time-limit 300]

Builds two random-weight qwen2 models (the demo's architecture and byte tokenizer: ``demo`` is
``dctms demo``'s model with its N = 128, M = 64 plan, ``small`` a 2-layer one with N = 64, M = 32)
under a temporary folder, compiles their plans, and starts one ``dctms serve`` for both on
127.0.0.1 (a free port). ``--clients`` threads, each with its own ``openai.OpenAI`` client, share
``--requests`` requests: models alternate, every other request streams, prompts cycle through a
few fixed texts, and every ``--refuse-every``-th request deliberately asks for M + 1 tokens (it must
be refused with HTTP 400). A thread polls ``/status`` every 20 ms throughout.

Checked (the script exits 1 when any fails, so a test can run it):
* every request answered (200) or cleanly refused (400 with an error body naming M, or 503 when
  the queue is full); none lost, none failed otherwise, all within ``--time-limit``;
* every answer equals ``dctms run``'s greedy output for the same model, prompt and max_tokens
  (token ids for plain answers, the text for streamed ones);
* MLX's observed peak <= the pool's provable envelope at every poll, and at the end.
Reported: requests/s (answered requests / wall time of the load), P50/P99 request latency (send to
last byte), time to first streamed token, the envelope vs the observed peak, the server's RSS.
Written to ``--json`` (default ``bench/results/serve_load.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The memory of a language model is a known number before it runs.",
    "Several models, one memory budget.",
    "A server that never exceeds its envelope",
    "greedy",
]
# name -> (config overrides of the demo model, seed, N, M)
MODELS = {
    "demo": ({}, 0, 128, 64),
    "small": ({"num_hidden_layers": 2, "intermediate_size": 256}, 1, 64, 32),
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def build(root: Path, tiny: bool) -> dict[str, dict]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

    out = {}
    for name, (overrides, seed, n, m) in MODELS.items():
        config = {**DEMO_CONFIG, **overrides, **(TINY if tiny else {})}
        if tiny:
            m = m // 4
        folder = root / name
        write_tiny_model(folder, config, seed=seed)
        plan = compile_plan(open_model(folder), CompileOptions(n, m, prefill_chunk=32))
        write_plan(plan, folder / f"{name}.plan")
        out[name] = {"plan": folder / f"{name}.plan", "folder": folder, "n": n, "m": m}
    return out


def dctms(*args: str) -> list[str]:
    return [sys.executable, "-m", "dctms.cli.main", *args]


def expected(models: dict, prompts: list[str], max_tokens: dict[str, int], tmp: Path) -> dict:
    """``dctms run``'s tokens and text for every (model, prompt), each in a fresh process."""
    out = {}
    for name, m in models.items():
        for i, prompt in enumerate(prompts):
            report = tmp / f"run-{name}-{i}.json"
            cmd = dctms("run", str(m["plan"]), "--model", str(m["folder"]), "--prompt", prompt,
                        "--max-tokens", str(max_tokens[name]), "--report", str(report))
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise SystemExit(f"dctms run failed: {proc.stderr.strip()}")
            doc = json.loads(report.read_text())
            out[(name, prompt)] = (doc["tokens"], doc["text"])
    return out


# The runner alone, in a process of its own that imports what the server imports of the runner and
# holds both sessions as the server does; reads "name<TAB>prompt<TAB>max_tokens" lines, answers
# each with the generation's wall time in seconds.
_ALONE = """
import json, sys, time
import mlx.core as mx
from dctms.runner.load import load_checked_plan
from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.runner.tokenize import Tokenizer
from dctms.schema.model_folder import open_model_folder
sessions = {}
for name, plan, folder in json.loads(sys.argv[1]):
    model = open_model_folder(folder)
    sessions[name] = (Session(load_checked_plan(plan), model), Tokenizer(model.path))
print("ready", flush=True)
for line in sys.stdin:
    name, prompt, max_tokens = line.rstrip("\\n").split("\\t")
    session, tok = sessions[name]
    session.apply_limits(max(0, mx.get_active_memory() - session.held_bytes()))
    request = validate_request(session.plan, tok.encode(prompt), int(max_tokens), tok.eos_ids)
    start = time.perf_counter()
    session.generate(request)
    print(time.perf_counter() - start, flush=True)
"""


class RunnerAlone:
    def __init__(self, models: dict):
        from dctms.runner.blas import planned_preload

        spec = json.dumps([[n, str(m["plan"]), str(m["folder"])] for n, m in models.items()])
        env = dict(os.environ)
        preload = planned_preload()  # the BLAS the server runs on
        if preload:
            env["LD_PRELOAD"] = preload
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ALONE, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the runner-alone process did not start")

    def generate_s(self, name: str, prompt: str, max_tokens: int) -> float:
        self.proc.stdin.write(f"{name}\t{prompt}\t{max_tokens}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def overhead(server: Server, models: dict, max_tokens: dict, rounds: int, openai) -> dict:
    """The server's cost per request: one client, one request at a time, against the runner alone
    generating the same tokens in a process of its own; interleaved A/B, the order flipping every
    round (this machine's load changes over seconds, so both sides see the same conditions).
    The server side is the client's wall time (HTTP and JSON included); the runner side the
    generation's."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    alone_proc = RunnerAlone(models)
    served, alone = [], []
    try:
        for r in range(rounds + 1):  # round 0 warms both up, unmeasured
            name = sorted(models)[r % len(models)]
            prompt = PROMPTS[r % len(PROMPTS)]
            timings = {}
            for label in ("server", "alone")[:: 1 if r % 2 else -1]:
                if label == "server":
                    start = time.perf_counter()
                    client.completions.create(model=name, prompt=prompt,
                                              max_tokens=max_tokens[name])
                    timings[label] = time.perf_counter() - start
                else:
                    timings[label] = alone_proc.generate_s(name, prompt, max_tokens[name])
            if r:
                served.append(timings["server"])
                alone.append(timings["alone"])
    finally:
        alone_proc.close()
    return {
        "rounds": rounds,
        "server_request_s_median": statistics.median(served),
        "runner_alone_s_median": statistics.median(alone),
        "ratio_median": statistics.median(a / b for a, b in zip(served, alone, strict=True)),
    }




class Server:
    def __init__(self, models: dict, memory: str):
        from dctms.benchmark.serve_clients import free_port, wait_ready

        args = []
        for name, m in models.items():
            args += ["--plan", f"{name}={m['plan']}={m['folder']}"]
        port = free_port()
        self.proc = subprocess.Popen(
            dctms("serve", *args, "--memory", memory, "--host", "127.0.0.1", "--port", str(port),
                  "--max-queue", "256"),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.log: list[str] = []
        # read stderr throughout: kept for the error message, and a full pipe would stall the server
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        try:
            wait_ready(self.url, self.proc)
        except RuntimeError as err:
            self.proc.kill()
            raise SystemExit(f"dctms serve did not start ({err}):\n" + "".join(self.log)) from None

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/status", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] if ordered else 0.0


def one_request(client, k: int, models: dict, max_tokens: dict, args) -> dict:
    import openai

    names = sorted(models)
    name = names[k % len(names)]
    prompt = PROMPTS[(k // len(names)) % len(PROMPTS)]
    stream = (k // (len(names) * len(PROMPTS))) % 2 == 1  # every (model, prompt) both ways
    refuse = args.refuse_every > 0 and k % args.refuse_every == args.refuse_every - 1
    want_tokens = models[name]["m"] + 1 if refuse else max_tokens[name]
    rec = {"k": k, "model": name, "prompt": prompt, "stream": stream, "deliberate_refusal": refuse}
    start = time.perf_counter()
    try:
        if stream:
            pieces, first = [], None
            for chunk in client.completions.create(
                model=name, prompt=prompt, max_tokens=want_tokens, stream=True
            ):
                if first is None:
                    first = time.perf_counter() - start
                pieces.extend(c.text for c in chunk.choices)
            rec.update(outcome="answered", text="".join(pieces), ttft_s=first)
        else:
            r = client.completions.create(
                model=name, prompt=prompt, max_tokens=want_tokens,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            rec.update(outcome="answered", text=r.choices[0].text,
                       tokens=r.choices[0].model_extra["token_ids"])
    except openai.BadRequestError as err:
        named = f"M = {models[name]['m']}" in str(err)
        rec.update(outcome="refused" if named else "failed", status=400, error=str(err)[:200])
    except openai.APIStatusError as err:
        rec.update(outcome="refused" if err.status_code == 503 else "failed",
                   status=err.status_code, error=str(err)[:200])
    except Exception as err:  # connection errors, timeouts: the server lost a request
        rec.update(outcome="failed", error=f"{type(err).__name__}: {err}"[:200])
    rec["latency_s"] = time.perf_counter() - start
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (capped at M)")
    p.add_argument("--refuse-every", type=int, default=25,
                   help="every K-th request asks for M + 1 tokens (0: never)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole load")
    p.add_argument("--memory", default="4GiB", help="the server's --memory (default 4GiB)")
    p.add_argument("--overhead-rounds", type=int, default=10,
                   help="interleaved one-at-a-time rounds, server vs runner alone (default 10)")
    p.add_argument("--tiny", action="store_true", help="much smaller models (for tests)")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve_load.json")
    args = p.parse_args(argv)

    import openai

    with tempfile.TemporaryDirectory(prefix="dctms-serve-load-") as tmp_name:
        tmp = Path(tmp_name)
        models = build(tmp, args.tiny)
        max_tokens = {n: min(args.max_tokens, m["m"]) for n, m in models.items()}
        want = expected(models, PROMPTS, max_tokens, tmp)
        server = Server(models, args.memory)
        try:
            result = drive(server, models, max_tokens, want, args, openai)
            result["overhead"] = overhead(server, models, max_tokens, args.overhead_rounds, openai)
        finally:
            result_rc = server.stop()
    result["server_exit_status"] = result_rc
    result["server_log_tail"] = server.log[-5:]
    ok = result["ok"] and result_rc == 0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    return 0 if ok else 1


def drive(server: Server, models: dict, max_tokens: dict, want: dict, args, openai) -> dict:
    provable = server.status()["envelope_provable_bytes"]
    samples: list[tuple[int, int, int]] = []  # (observed MLX peak, queue waiting, RSS)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            st = server.status()
            samples.append(
                (st["observed_mlx_peak_bytes"], st["queue_waiting"], st["rss_bytes"])
            )
            stop.wait(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    clients = [openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                             timeout=120) for _ in range(args.clients)]
    deadline = time.monotonic() + args.time_limit
    poller.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        futures = []
        for k in range(args.requests):
            client = clients[k % args.clients]

            def task(k=k, client=client):
                if time.monotonic() > deadline:
                    return {"k": k, "outcome": "not sent (time limit)", "latency_s": 0.0}
                return one_request(client, k, models, max_tokens, args)

            futures.append(pool.submit(task))
        records = [f.result() for f in futures]
    wall = time.perf_counter() - start
    stop.set()
    poller.join()
    final = server.status()

    mismatches = []
    for r in records:
        if r["outcome"] != "answered":
            continue
        tokens, text = want[(r["model"], r["prompt"])]
        same = r["text"] == text and ("tokens" not in r or r["tokens"] == tokens)
        if not same:
            mismatches.append(r["k"])
    counts: dict[str, int] = {}
    for r in records:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    answered = [r for r in records if r["outcome"] == "answered"]
    lat = [r["latency_s"] for r in answered]
    ttft = [r["ttft_s"] for r in answered if r.get("ttft_s") is not None]
    # every over-M request refused naming M, and nothing else refused but for a full queue (503)
    refused_ok = all(
        (r["outcome"] == "refused" and r.get("status") == 400) == r.get("deliberate_refusal", False)
        for r in records
    )
    peaks = [s[0] for s in samples]
    over = [s for s in samples if s[0] > provable]
    result = {
        "requests": args.requests,
        "clients": args.clients,
        "max_tokens": max_tokens,
        "models": {n: {"N": m["n"], "M": m["m"]} for n, m in models.items()},
        "outcomes": counts,
        "deliberate_refusals": sum(r.get("deliberate_refusal", False) for r in records),
        "mismatches_vs_dctms_run": mismatches,
        "wall_s": wall,
        "requests_per_s": len(answered) / wall if wall else 0.0,
        "latency_p50_s": percentile(lat, 0.50),
        "latency_p99_s": percentile(lat, 0.99),
        "latency_mean_s": statistics.fmean(lat) if lat else 0.0,
        "stream_ttft_p50_s": percentile(ttft, 0.50),
        "generated_tokens": sum(len(want[(r["model"], r["prompt"])][0]) for r in answered),
        "service_s_mean": wall / len(answered) if answered else 0.0,
        "envelope_provable_bytes": provable,
        "envelope_total_bytes": final["envelope_total_bytes"],
        "observed_mlx_peak_bytes": final["observed_mlx_peak_bytes"],
        "status_samples": len(samples),
        "max_peak_sampled_bytes": max(peaks, default=0),
        "samples_over_envelope": len(over),
        "max_queue_waiting_sampled": max((s[1] for s in samples), default=0),
        "server_rss_bytes_at_end": final["rss_bytes"],
        # RSS against the pool's M_max with runtime: reported, not checked (the runtime allowance
        # is an estimate of what lives outside MLX, not a bound MLX enforces).
        "max_rss_sampled_bytes": max((s[2] for s in samples), default=0),
        "records": records,
    }
    result["ok"] = (
        counts.get("answered", 0) + counts.get("refused", 0) == args.requests
        and not mismatches
        and refused_ok
        and not over
        and final["observed_mlx_peak_bytes"] <= provable
        and len(samples) > 0
    )
    return result


def summary(r: dict) -> str:
    mib = 2**20
    outcomes = ", ".join(f"{v} {k}" for k, v in sorted(r["outcomes"].items()))
    return "\n".join([
        f"{r['requests']} requests from {r['clients']} clients: {outcomes} "
        f"({r['deliberate_refusals']} deliberately over M)",
        f"answers equal to dctms run: {'yes' if not r['mismatches_vs_dctms_run'] else 'NO'} "
        f"({len(r['mismatches_vs_dctms_run'])} mismatches)",
        f"throughput {r['requests_per_s']:.1f} requests/s over {r['wall_s']:.2f} s "
        f"({r['generated_tokens'] / r['wall_s']:.0f} generated tokens/s)",
        f"one request at a time ({r['overhead']['rounds']} interleaved rounds): server "
        f"{r['overhead']['server_request_s_median'] * 1000:.1f} ms vs runner alone "
        f"{r['overhead']['runner_alone_s_median'] * 1000:.1f} ms (median ratio "
        f"{r['overhead']['ratio_median']:.2f})",
        f"latency P50 {r['latency_p50_s'] * 1000:.1f} ms, P99 {r['latency_p99_s'] * 1000:.1f} ms; "
        f"stream TTFT P50 {r['stream_ttft_p50_s'] * 1000:.1f} ms; "
        f"largest queue seen {r['max_queue_waiting_sampled']}",
        f"pool envelope (provable) {r['envelope_provable_bytes']:,} B "
        f"({r['envelope_provable_bytes'] / mib:.2f} MiB); observed MLX peak "
        f"{r['observed_mlx_peak_bytes']:,} B ({r['observed_mlx_peak_bytes'] / mib:.2f} MiB); "
        f"{r['status_samples']} /status samples, {r['samples_over_envelope']} over",
        f"pool M_max with runtime {r['envelope_total_bytes'] / mib:.2f} MiB; server RSS max "
        f"{r['max_rss_sampled_bytes'] / mib:.2f} MiB, at end {r['server_rss_bytes_at_end'] / mib:.2f} MiB",
        f"all checks: {'PASS' if r['ok'] else 'FAIL'}",
    ])  # fmt: skip


if __name__ == "__main__":
    from dctms.runner.blas import reexec_with_fast_blas

    reexec_with_fast_blas()  # the warm baseline on the BLAS the server runs on
    sys.exit(main())
