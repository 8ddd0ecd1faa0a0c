"""``dctms run PLAN --batch-prompts FILE.jsonl``: many prompts through a batched plan's slots.

Each line of the file is a JSON object: ``{"prompt": TEXT}`` (through the chat template, as
``--prompt``) or ``{"tokens": [IDS]}``, with an optional ``"max_tokens"`` (default: ``--max-tokens``
or the plan's M). The prompts queue for the plan's B slots (``runner.batch``); each result is one
JSON line on stdout, in the file's order; the summary (throughput, slot use, provable vs observed)
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dctms.schema.errors import DctmsError
from dctms.schema.slotted import slotted

MIB = 2**20


def read_prompt_lines(path: str) -> list[dict]:
    """The file's JSON objects; one line naming the first bad line otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DctmsError(f"--batch-prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DctmsError(f"--batch-prompts {path}: cannot read it ({err})") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as err:
            raise DctmsError(f"--batch-prompts {path}:{number}: not JSON ({err})") from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("tokens" in entry):
            raise DctmsError(
                f"--batch-prompts {path}:{number}: expected an object with either \"prompt\" "
                'or "tokens"'
            )
        prompt, tokens = entry.get("prompt"), entry.get("tokens")
        if prompt is not None and not isinstance(prompt, str):
            raise DctmsError(f'--batch-prompts {path}:{number}: "prompt" must be a string')
        if tokens is not None and not (
            isinstance(tokens, list) and all(type(t) is int for t in tokens)
        ):
            raise DctmsError(f'--batch-prompts {path}:{number}: "tokens" must be a list of ids')
        limit = entry.get("max_tokens")
        if limit is not None and type(limit) is not int:
            raise DctmsError(f'--batch-prompts {path}:{number}: "max_tokens" must be an integer')
        entries.append({**entry, "line": number})
    if not entries:
        raise DctmsError(f"--batch-prompts {path}: no prompts in it")
    return entries


def run_batch_prompts(args: argparse.Namespace, plan, model, target) -> int:
    from dctms.cli.run_summary import EXIT_OVER_ENVELOPE
    from dctms.runner.batch import BatchSession, EnvelopeExceeded
    from dctms.runner.measure import RssSampler
    from dctms.runner.request import RequestRefused, validate_request
    from dctms.runner.tokenize import Tokenizer, encode_chat, eos_ids

    if not slotted(plan.bounds):
        raise DctmsError(
            "--batch-prompts runs the prompts together in a batched plan's slots; this plan has "
            "batch 1: compile it with --batch B (B > 1)"
        )
    entries = read_prompt_lines(args.batch_prompts)
    tokenizer = None
    if any("prompt" in e for e in entries) or (model.path / "tokenizer.json").is_file():
        tokenizer = Tokenizer(model.path)
    stop = set() if args.ignore_eos else eos_ids(model.path, tokenizer)
    default_max = args.max_tokens if args.max_tokens is not None else plan.bounds.output_tokens
    requests = []
    for e in entries:
        if "prompt" in e:
            if args.ignore_chat_template:
                ids = tokenizer.encode(e["prompt"])
            else:
                ids = encode_chat(tokenizer, e["prompt"], args.system_prompt)
        else:
            ids = e["tokens"]
        try:
            requests.append(validate_request(plan, ids, e.get("max_tokens", default_max), stop))
        except RequestRefused as err:
            raise DctmsError(f"--batch-prompts {args.batch_prompts}:{e['line']}: {err}") from None
    with RssSampler() as rss:
        session = BatchSession(plan, model, verify_hashes=args.verify_weights)
        recorded = session.prerecord()
        start = time.perf_counter()
        sequences = [session.submit(r) for r in requests]
        exceeded = None
        try:
            session.run_all()
        except EnvelopeExceeded as err:
            exceeded = str(err)
        wall = time.perf_counter() - start
    results = []
    for e, seq in zip(entries, sequences, strict=True):
        gen = seq.generation
        row = {"line": e["line"], "tokens": gen.tokens, "finish_reason": seq.finish or "error"}
        if tokenizer is not None:
            row["text"] = tokenizer.decode([t for t in gen.tokens if t not in stop])
        row["ttft_s"] = round(gen.ttft_s, 4)
        if gen.cached_tokens is not None:  # a plan with a prefix pool: prompt tokens not prefilled
            row["cached_tokens"] = gen.cached_tokens
        results.append(row)
        print(json.dumps(row, ensure_ascii=False))
    report = batch_report(plan, session, results, wall, rss.peak, recorded)
    if target is not None:
        target.write(json.dumps(report, indent=2).encode() + b"\n")
    print(batch_summary(report), file=sys.stderr)
    if exceeded is not None or not report["within_envelope"]:
        print(f"dctms run: {exceeded or 'observed MLX peak above the envelope'}", file=sys.stderr)
        return EXIT_OVER_ENVELOPE
    return 0


def batch_report(plan, session, results: list[dict], wall_s: float, rss_peak: int, recorded):
    stats = session.stats
    generated = sum(len(r["tokens"]) for r in results)
    observed = session.observed_peak()
    return {
        "batch": plan.bounds.batch,
        "prompts": len(results),
        "generated_tokens": generated,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(generated / wall_s, 2) if wall_s > 0 else None,
        "iterations": stats.iterations,
        "prefill_calls": stats.prefill_calls,
        "decode_steps": stats.decode_steps,
        "rows_busy": stats.rows_busy,
        "rows_computed": stats.rows_computed,
        "slot_moves": stats.moves,
        "prefix_pool": session.pool_summary(),
        "provable_bytes": plan.envelope.provable,
        "envelope": {"total": plan.envelope.total},
        "observed": {"mlx_peak_bytes": observed, "rss_peak_bytes": rss_peak},
        "within_envelope": observed <= plan.envelope.provable,
        "setup": {"recorded_points": recorded.points, "record_s": round(recorded.seconds, 3)},
        "results": results,
    }


def pool_line(pool: dict | None) -> list[str]:
    """The prefix pool's line of the summary (none without a pool)."""
    if pool is None:
        return []
    return [
        f"prefix pool: {pool['hit_tokens']} prompt tokens from {pool['hit_blocks']} cached blocks "
        f"({pool['whole_prompt_hits']} prompts held whole: no prefill call), "
        f"{pool['saved_blocks']} blocks saved ({pool['history_chunks']} answer chunks prefilled "
        f"again for a next turn), {pool['evictions']} evicted, "
        f"{pool['used']} of {pool['blocks']} in use"
    ]


def batch_summary(report: dict) -> str:
    obs = report["observed"]
    busy, computed = report["rows_busy"], report["rows_computed"]
    use = f"{busy / computed:.0%}" if computed else "n/a"
    return "\n".join(
        [
            f"{report['prompts']} prompts through {report['batch']} slots: "
            f"{report['generated_tokens']} tokens in {report['wall_s']:.2f} s "
            f"({report['tokens_per_s']} tok/s); {report['decode_steps']} decode steps, "
            f"{report['prefill_calls']} prefill calls; rows busy / computed {busy} / {computed} "
            f"({use}); {report['slot_moves']} slot moves",
            *pool_line(report["prefix_pool"]),
            f"{'':24}{'bytes':>16}{'MiB':>12}",
            f"{'provable peak':24}{report['provable_bytes']:>16,}"
            f"{report['provable_bytes'] / MIB:>12.2f}",
            f"{'observed MLX peak':24}{obs['mlx_peak_bytes']:>16,}"
            f"{obs['mlx_peak_bytes'] / MIB:>12.2f}",
            f"{'M_max':24}{report['envelope']['total']:>16,}"
            f"{report['envelope']['total'] / MIB:>12.2f}",
            f"{'observed RSS peak':24}{obs['rss_peak_bytes']:>16,}"
            f"{obs['rss_peak_bytes'] / MIB:>12.2f}",
            f"within envelope: {'yes' if report['within_envelope'] else 'NO'} "
            "(checked after every call)",
        ]
    )
