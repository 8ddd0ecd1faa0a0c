"""Where a batched run's time goes, without HTTP: the serving benchmark's load run in-process.

    .venv/bin/python bench/batch_loop.py [--model DIR] [-N 256] [-M 64] [--batch 8]
        [--requests 32] [--max-tokens 64] [--prerecord] [--compare-moves] [--mlx-lm]

The plan (compiled at -N/-M with ``--batch`` slots, as bench/serve_vs_mlx_lm.py compiles it) runs
in a ``BatchSession`` in this process: the first ``--batch`` requests are queued at once and each
ended request is replaced by the next (what ``--batch`` clients that ask again at once do), over
the serving benchmark's eight chat prompts, greedy, up to ``--max-tokens`` each, ending at the
tokenizer's end-of-sequence ids as the server's requests do. Printed: completion tokens per second, the time in prefill calls and in decode steps, and
the decode steps by how many of their rows were busy, with the median cost of each. Compared with
the serving benchmark's figure at the same number of clients, the difference is what HTTP,
streaming and detokenising cost. ``--prerecord`` records every length point's graphs first (as
``dctms serve --prerecord``); ``--compare-moves`` runs the load a second time with the runner's
slot moves off (``runner.batch``: a sequence left above a free slot is moved down so that the steps
compute only the busy rows), a baseline in the same process. ``--mlx-lm`` then runs the same load
through mlx-lm's own continuous batching (``mlx_lm.generate.BatchGenerator`` with
``completion_batch_size`` and ``prefill_batch_size`` at ``--batch``, as bench/serve_vs_mlx_lm.py
starts mlx_lm.server, but without its prompt cache) on the same model folder, in a child process
of its own (MLX's memory and cache limits, which the dctms session sets, are process-wide), and
prints the ratio of the two engines' tokens per second in this one run. Runs with OpenBLAS preloaded,
as ``dctms serve`` does.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model folder (default: SmolLM2 as dctms demo has it)")
    p.add_argument("-N", type=int, default=256)
    p.add_argument("-M", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prerecord", action="store_true", help="record every point's graphs first")
    p.add_argument(
        "--compare-moves", action="store_true",
        help="run the load twice: with slot moves, then without (the runner before move_slot)",
    )  # fmt: skip
    p.add_argument(
        "--mlx-lm", action="store_true",
        help="then the same load through mlx-lm's BatchGenerator, and the ratio of the two",
    )  # fmt: skip
    p.add_argument("--only-mlx-lm", action="store_true", help=argparse.SUPPRESS)  # the child
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "bench"))
    from batched_plan import compile_batched, model_or_demo

    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import Request
    from dctms.schema.model_folder import open_model_folder

    folder = model_or_demo(args.model)
    if args.only_mlx_lm:
        prompts, stop = chat_prompts(folder, args.requests)
        run_mlx_lm(folder, prompts, min(args.max_tokens, args.M), stop, args.batch)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = compile_batched(folder, args.N, args.M, args.batch, Path(tmp) / "batch.plan")
        plan = load_checked_plan(str(out))
    session = BatchSession(plan, open_model_folder(str(folder)))
    mover = session.move
    if args.prerecord:  # as `dctms serve --prerecord`: no step pays a point's first use
        done = session.prerecord()
        print(f"prerecorded {done.points} length points in {done.seconds:.2f} s")
    prompts, stop = chat_prompts(folder, args.requests)
    longest = max(len(x) for x in prompts)
    if longest > plan.bounds.input_tokens:
        p.error(f"a prompt has {longest} tokens, more than -N {plan.bounds.input_tokens}")
    budget = min(args.max_tokens, args.M)
    session.submit(Request(plan, prompts[0], budget, stop))  # warm-up: every point's graphs
    session.run_all()
    tok_s = []  # the runner as it is first (with slot moves), then without them
    for moves in (True, False) if args.compare_moves else (True,):
        if args.compare_moves:
            print(f"-- {'with' if moves else 'without'} slot moves")
        session.move = mover if moves else None
        tok_s.append(run_load(session, plan, prompts, budget, stop, args.batch))
    if args.mlx_lm:
        child = [sys.executable, __file__, "--only-mlx-lm", "--model", str(folder), "-M", str(args.M),
                 "--batch", str(args.batch), "--requests", str(args.requests),
                 "--max-tokens", str(args.max_tokens)]  # fmt: skip
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        print(out, end="")
        theirs = float(re.findall(r"([\d.]+) tok/s", out)[-1])
        print(f"dctms / mlx-lm BatchGenerator: {tok_s[0] / theirs:.3f} (tok/s, one run)")
    return 0


def chat_prompts(folder: Path, requests: int) -> tuple[list[tuple[int, ...]], frozenset[int]]:
    """The serving benchmark's prompts, cycled to ``requests``, as chat ids; the stop ids."""
    from serve_vs_mlx_lm import PROMPTS

    from dctms.runner.tokenize import Tokenizer, encode_chat

    tokenizer = Tokenizer(folder)
    prompts = [tuple(encode_chat(tokenizer, PROMPTS[i % len(PROMPTS)], None)) for i in range(requests)]
    return prompts, frozenset(tokenizer.eos_ids)


def run_load(session, plan, prompts, budget: int, stop: frozenset, clients: int) -> float:
    """``clients`` requests queued at once, each ended one replaced by the next; printed. Returns
    the tokens per second."""
    from dctms.runner.request import Request

    prefill_s, decode_by_rows = 0.0, {}
    inner_prefill, inner_decode = session._prefill_chunk, session._decode_step

    def prefill(seq):
        nonlocal prefill_s
        t = time.perf_counter()
        inner_prefill(seq)
        prefill_s += time.perf_counter() - t

    def decode(decoding):
        t = time.perf_counter()
        ended = inner_decode(decoding)
        decode_by_rows.setdefault(len(decoding), []).append(time.perf_counter() - t)
        return ended

    session._prefill_chunk, session._decode_step = prefill, decode
    calls0, steps0 = session.stats.prefill_calls, session.stats.decode_steps
    moves0 = session.stats.moves
    waiting = list(prompts)
    seqs = [session.submit(Request(plan, waiting.pop(0), budget, stop))
            for _ in range(min(clients, len(waiting)))]  # fmt: skip
    start = time.perf_counter()
    while not session.idle:
        for _ in session.iterate():
            if waiting:
                seqs.append(session.submit(Request(plan, waiting.pop(0), budget, stop)))
    wall = time.perf_counter() - start
    session._prefill_chunk, session._decode_step = inner_prefill, inner_decode
    tokens = sum(len(s.generation.tokens) for s in seqs)
    decode_s = sum(sum(v) for v in decode_by_rows.values())
    print(
        f"{len(prompts)} requests of up to {budget} tokens over {clients} slots, in process: "
        f"{tokens} tokens in {wall:.2f} s, {tokens / wall:.2f} tok/s"
    )
    print(
        f"prefill calls: {session.stats.prefill_calls - calls0}, {prefill_s:.2f} s; decode steps: "
        f"{session.stats.decode_steps - steps0}, {decode_s:.2f} s; "
        f"other {wall - prefill_s - decode_s:.2f} s (slot moves: {session.stats.moves - moves0})"
    )
    for rows in sorted(decode_by_rows):
        times = decode_by_rows[rows]
        print(
            f"  decode steps with {rows} busy rows: {len(times)}, "
            f"median {1000 * statistics.median(times):.1f} ms"
        )
    return tokens / wall


def run_mlx_lm(folder: Path, prompts, budget: int, stop: frozenset, clients: int) -> float:
    """The same load through mlx-lm's BatchGenerator (``clients`` sequences decoded and prefilled
    together, each ended one replaced by the next at once); printed. Returns the tokens per
    second."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(str(folder))

    def once(load_prompts) -> tuple[int, float, object]:
        gen = BatchGenerator(
            model, max_tokens=budget, stop_tokens=[[t] for t in sorted(stop)],
            completion_batch_size=clients, prefill_batch_size=clients,
        )  # fmt: skip
        waiting = [list(x) for x in load_prompts]
        live = len(gen.insert([waiting.pop(0) for _ in range(min(clients, len(waiting)))]))
        tokens, start = 0, time.perf_counter()
        with gen.stats() as stats:  # its prompt and decode time over the load
            while live:
                for response in gen.next_generated():
                    tokens += 1
                    if response.finish_reason is not None:
                        live -= 1
                        if waiting:
                            live += len(gen.insert([waiting.pop(0)]))
        wall = time.perf_counter() - start
        gen.close()
        return tokens, wall, stats

    once(prompts[:1])  # warm-up, as the dctms run had
    tokens, wall, c = once(prompts)
    print(f"-- mlx-lm BatchGenerator, {clients} sequences at once, the same prompts")
    print(
        f"{len(prompts)} requests of up to {budget} tokens, in process: "
        f"{tokens} tokens in {wall:.2f} s, {tokens / wall:.2f} tok/s"
    )
    print(
        f"prompt processing: {c.prompt_tokens} tokens, {c.prompt_time:.2f} s; decode steps: "
        f"{c.generation_steps}, {c.decode_time:.2f} s"
    )
    return tokens / wall


if __name__ == "__main__":
    from dctms.runner.blas import reexec_with_fast_blas

    reexec_with_fast_blas()  # the BLAS `dctms serve` uses (a no-op when already preloaded)
    raise SystemExit(main())
