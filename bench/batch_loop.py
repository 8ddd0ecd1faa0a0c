"""Where a batched run's time goes, without HTTP: the serving benchmark's load run in-process.

    .venv/bin/python bench/batch_loop.py [--model DIR] [-N 256] [-M 64] [--batch 8]
        [--requests 32] [--max-tokens 64] [--prerecord] [--compare-moves]

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
compute only the busy rows), a baseline in the same process. Runs with OpenBLAS preloaded, as
``dctms serve`` does.
"""

from __future__ import annotations

import argparse
import statistics
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
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "bench"))
    from batched_plan import compile_batched, model_or_demo
    from serve_vs_mlx_lm import PROMPTS

    from dctms.runner.batch import BatchSession
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import Request
    from dctms.runner.tokenize import Tokenizer, encode_chat
    from dctms.schema.model_folder import open_model_folder

    folder = model_or_demo(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        out = compile_batched(folder, args.N, args.M, args.batch, Path(tmp) / "batch.plan")
        plan = load_checked_plan(str(out))
    session = BatchSession(plan, open_model_folder(str(folder)))
    mover = session.move
    if args.prerecord:  # as `dctms serve --prerecord`: no step pays a point's first use
        done = session.prerecord()
        print(f"prerecorded {done.points} length points in {done.seconds:.2f} s")
    tokenizer = Tokenizer(folder)
    prompts = [
        tuple(encode_chat(tokenizer, PROMPTS[i % len(PROMPTS)], None))
        for i in range(args.requests)
    ]
    longest = max(len(x) for x in prompts)
    if longest > plan.bounds.input_tokens:
        p.error(f"a prompt has {longest} tokens, more than -N {plan.bounds.input_tokens}")
    budget = min(args.max_tokens, args.M)
    stop = frozenset(tokenizer.eos_ids)
    session.submit(Request(plan, prompts[0], budget, stop))  # warm-up: every point's graphs
    session.run_all()
    for moves in (True, False) if args.compare_moves else (True,):
        if args.compare_moves:
            print(f"-- {'with' if moves else 'without'} slot moves")
        session.move = mover if moves else None
        run_load(session, plan, prompts, budget, stop, args.batch)
    return 0


def run_load(session, plan, prompts, budget: int, stop: frozenset, clients: int) -> None:
    """``clients`` requests queued at once, each ended one replaced by the next; printed."""
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


if __name__ == "__main__":
    from dctms.runner.blas import reexec_with_fast_blas

    reexec_with_fast_blas()  # the BLAS `dctms serve` uses (a no-op when already preloaded)
    raise SystemExit(main())
