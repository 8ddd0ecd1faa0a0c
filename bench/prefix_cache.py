"""Multi-turn chats through `dctms serve` with and without its prefix pool, and mlx_lm.server with
its prompt cache (issue #31, item 5).

    python bench/prefix_cache.py MODEL_DIR [--conversations 10] [--turns 6] [--think-s S] [--json FILE]

Each conversation is a chat whose every turn re-sends the whole history (the earlier questions and
the answers the server gave), as a chat client does; the conversations run one after the other, one
client, greedy, streamed. ``--think-s`` is the pause between an answer and the next question (a
person reading and typing; 0, the default, sends the next turn at once). Both dctms plans use ``--chunk`` (64) as their prefill chunk, the pool's
block size. Three systems on the same model folder and the same BLAS (OpenBLAS for
both, see bench/serve_vs_mlx_lm.py): dctms with a plan compiled with ``--prefix-blocks`` (a pool
large enough for every conversation's history), dctms with the same plan but no pool, and
mlx_lm.server (its LRU prompt cache on by default). Reported per turn: TTFT (median over the
conversations), the prompt tokens the server took from its cache (dctms reports them in
``usage.prompt_tokens_details.cached_tokens``), and per system the peak RSS of the server process;
for dctms also M_max and the observed MLX peak (polled from /status).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batched_plan import compile_batched  # noqa: E402
from serve_vs_mlx_lm import server_env, tree_rss  # noqa: E402

from dctms.benchmark.serve_clients import free_port, stop_server, wait_ready  # noqa: E402

TOPICS = ["the sea", "a mountain", "bread", "a bicycle", "the moon", "tea", "a library",
          "rain", "a violin", "a garden", "trains", "snow"]  # fmt: skip
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give an example.", "Say it differently.",
              "What else should I know?", "Summarise what you said."]  # fmt: skip


def dctms_status(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/status", timeout=5) as r:
        return json.loads(r.read())


def conversation_turns(k: int, turns: int) -> list[str]:
    return [f"In two sentences, tell me about {TOPICS[k % len(TOPICS)]}.",
            *FOLLOW_UPS[: turns - 1]]  # fmt: skip


def run_system(name: str, argv: list[str], model: str, args) -> dict:
    from dctms.benchmark.serve_clients import PeakPoller, stream_messages

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([*argv, "--port", str(port)], env=server_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    out: dict = {"system": name, "turns": [[] for _ in range(args.turns)]}
    try:
        wait_ready(url, proc)
        polls = (lambda: dctms_status(url)) if name.startswith("dctms") else (lambda: None)
        with PeakPoller(lambda: tree_rss(proc.pid)) as rss, PeakPoller(polls, 0.2) as status:
            for k in range(args.conversations):
                messages: list[dict] = []
                for t, text in enumerate(conversation_turns(k, args.turns)):
                    messages.append({"role": "user", "content": text})
                    a = stream_messages(url, model, messages, args.max_tokens, 600)
                    if a.error:
                        raise RuntimeError(f"{name}: conversation {k} turn {t + 1}: {a.error}")
                    messages.append({"role": "assistant", "content": a.text})
                    time.sleep(args.think_s)
                    out["turns"][t].append({"ttft_s": a.ttft_s, "cached": a.cached_tokens})
        out["peak_rss"] = max(rss.values, default=None)
        seen = [s for s in status.values if s]
        if seen:
            out["m_max"] = seen[-1]["envelope_total_bytes"]
            out["provable"] = seen[-1]["envelope_provable_bytes"]
            out["observed_peak"] = max(s["observed_mlx_peak_bytes"] for s in seen)
    except RuntimeError as err:
        out["error"] = str(err)
    finally:
        stop_server(proc)
    return out


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def table(runs: list[dict]) -> list[str]:
    names = [r["system"] for r in runs]
    lines = ["| turn | " + " | ".join(f"{n} TTFT P50 s | {n} cached tokens" for n in names) + " |",
             "|---:|" + "---:|---:|" * len(runs)]  # fmt: skip
    for t in range(len(runs[0]["turns"])):
        cells = []
        for r in runs:
            rows = r["turns"][t]
            ttft = median([x["ttft_s"] for x in rows])
            cached = [x["cached"] for x in rows if x["cached"] is not None]
            cells += ["n/a" if ttft is None else f"{ttft:.3f}",
                      f"{sum(cached) / len(cached):.0f}" if cached else "n/a"]  # fmt: skip
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--conversations", type=int, default=10)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="seconds between an answer and the next turn (default 0)")
    ap.add_argument("-N", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=64)
    # a block is one prefill chunk: chats of a few hundred tokens need blocks finer than the
    # default chunk (min(N, 512)); both dctms plans use it
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--systems", default="dctms-pool,dctms,mlx_lm")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        plans = {"dctms-pool": Path(tmp, "pool.plan"), "dctms": Path(tmp, "plain.plan")}
        wanted = args.systems.split(",")
        for name, blocks in (("dctms-pool", args.blocks), ("dctms", 0)):
            if name in wanted:
                pool = ["--prefix-blocks", str(blocks)] if blocks else []
                compile_batched(Path(args.model), args.N, args.max_tokens, 2, plans[name],
                                "--prefill-chunk", str(args.chunk), *pool)  # fmt: skip
        for name in wanted:
            if name.startswith("dctms"):
                argv_ = [sys.executable, "-m", "dctms.cli.main", "serve", "--plan",
                         f"m={plans[name]}={args.model}"]  # fmt: skip
                runs.append(run_system(name, argv_, "m", args))
            else:
                argv_ = [sys.executable, "-m", "mlx_lm", "server", "--model", args.model,
                         "--log-level", "WARNING"]  # fmt: skip
                runs.append(run_system(name, argv_, "default_model", args))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench/prefix_cache.py {args.model}: {args.conversations} conversations x "
          f"{args.turns} turns, {args.max_tokens} tokens per answer, one client, "
          f"{args.think_s:g} s between an answer and the next turn; {stamp}")
    print("\n".join(table(runs)))
    for r in runs:
        extra = ""
        if "m_max" in r:
            extra = (f"; M_max {r['m_max']:,} B, observed MLX peak {r['observed_peak']:,} B "
                     f"(provable {r['provable']:,} B)")  # fmt: skip
        print(f"{r['system']}: peak RSS {r.get('peak_rss') or 0:,} B{extra}"
              + (f"; ERROR {r['error']}" if "error" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")
    return 0 if not any("error" in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
