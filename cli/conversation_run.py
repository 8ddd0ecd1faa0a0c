"""``dctms run PLAN --conversation FILE.json``: a multi-turn chat through one session.

The file is ``{"system": TEXT (optional), "turns": [TEXT, ...]}``: each turn is a user message; the
prompt of turn k is the whole conversation so far (every earlier message and answer) through the
chat template, as a chat client re-sends it. With a plan compiled with ``--prefix-blocks`` the
earlier turns' prompt chunks are found in the pool (``runner.prefix_cache``) and only the rest is
prefilled; one JSON line per turn on stdout says how many prompt tokens came from the pool, and the
answer's ids are those a plan without the pool generates. The report (``--report``) keeps the pool's
events per turn (blocks hit, saved, evicted; the block table after it): ``dctms show PLAN --run
REPORT`` and ``dctms-tui PLAN --run REPORT`` draw them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.slotted import slotted


def read_conversation(path: str) -> tuple[str | None, list[str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DctmsError(f"--conversation {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DctmsError(f"--conversation {path}: cannot read it as JSON ({err})") from None
    turns = data.get("turns") if isinstance(data, dict) else None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise DctmsError(f'--conversation {path}: expected {{"turns": [TEXT, ...]}} with turns')
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise DctmsError(f'--conversation {path}: "system" must be a string')
    return system, turns


def run_conversation(args: argparse.Namespace, plan, model, target) -> int:
    from dctms.cli.batch_run import pool_line
    from dctms.cli.run_summary import EXIT_OVER_ENVELOPE
    from dctms.runner.batch import BatchSession, EnvelopeExceeded
    from dctms.runner.request import RequestRefused, validate_request
    from dctms.runner.session import Session
    from dctms.runner.tokenize import Tokenizer, encode_chat, eos_ids

    system, turns = read_conversation(args.conversation)
    tokenizer = Tokenizer(model.path)
    stop = set() if args.ignore_eos else eos_ids(model.path, tokenizer)
    max_tokens = args.max_tokens if args.max_tokens is not None else plan.bounds.output_tokens
    session = (BatchSession if slotted(plan.bounds) else Session)(
        plan, model, verify_hashes=args.verify_weights
    )
    session.prerecord()
    pool = getattr(session, "prefix", None)
    if pool is not None:
        pool.start_recording()  # the report's pool_events: what `dctms show --run` draws
    messages: list[dict] = []
    rows, pool_events = [], []
    for k, text in enumerate(turns, 1):
        messages.append({"role": "user", "content": text})
        prompt = encode_chat(tokenizer, messages, system if system is not None else args.system_prompt)
        try:
            request = validate_request(plan, prompt, max_tokens, stop)
        except RequestRefused as err:
            raise DctmsError(f"--conversation {args.conversation}: turn {k}: {err}") from None
        cached = 0
        try:
            if isinstance(session, BatchSession):
                seq = session.submit(request)
                session.run_all(histories=True)  # the next turn re-sends this answer
                gen, cached = seq.generation, seq.cached
            else:
                gen = session.generate(request)
        except EnvelopeExceeded as err:
            print(f"dctms run: {err}", file=sys.stderr)
            return EXIT_OVER_ENVELOPE
        answer = tokenizer.decode([t for t in gen.tokens if t not in stop])
        messages.append({"role": "assistant", "content": answer})
        row = {"turn": k, "prompt_tokens": len(prompt), "cached_tokens": cached,
               "ttft_s": round(gen.ttft_s, 4), "tokens": gen.tokens, "text": answer}  # fmt: skip
        rows.append(row)
        if pool is not None:
            pool_events += [{"turn": k, **e.as_json(pool.block_tokens)} for e in pool.events]
            pool.events.clear()
        print(json.dumps(row, ensure_ascii=False))
    observed = session.observed_peak()
    within = observed <= plan.envelope.provable
    summary = None if pool is None else session.pool_summary()
    report = {
        "turns": rows,
        "provable_bytes": plan.envelope.provable,
        "observed": {"mlx_peak_bytes": observed},
        "within_envelope": within,
        "prefix_pool": summary,
        "pool_events": pool_events,  # per turn: blocks hit, saved, evicted; the table after it
    }  # fmt: skip
    if target is not None:
        target.write(json.dumps(report, indent=2).encode() + b"\n")
    hits = "no prefix pool" if summary is None else pool_line(summary)[0]
    print(
        f"{len(turns)} turns; {hits}; observed MLX peak {observed:,} B, provable "
        f"{plan.envelope.provable:,} B: within envelope: {'yes' if within else 'NO'}",
        file=sys.stderr,
    )
    return 0 if within else EXIT_OVER_ENVELOPE
