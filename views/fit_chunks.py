"""``dctms fit --search chunk``: one fit per candidate prefill chunk, and the trade between them.

A smaller chunk shrinks prefill's transient workspace (attention scores are [.., chunk, capacity]),
so more tokens fit; but every prefill call reads all weights again, so TTFT grows. Each row gives the
largest N (or M) at that chunk, its M_max, and the roofline's predicted TTFT and decode speed for the
plan at the fit, so the user sees both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dctms.figures.roofline import plan_roofline, seconds_text, tokens_per_s_text
from dctms.figures.units import human
from dctms.schema.types import Plan

DEFAULT_CHUNKS = (32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class ChunkRow:
    chunk: int
    value: int | None  # largest N (or M) at this chunk; None when even 1 does not fit
    m_max: int | None  # at the fit
    next_total: int | None  # M_max at value + 1 (None when capped or nothing fits)
    compiles: int
    ttft_s: float | None  # predicted, for a prompt of `prompt_tokens`
    ttft_at_fit_s: float | None  # predicted, for the longest prompt the fit allows
    decode_tokens_per_s: float | None  # predicted, at the fit


def chunk_row(
    chunk: int,
    value: int | None,
    plan: Plan | None,
    next_total: int | None,
    compiles: int,
    prompt_tokens: int,
) -> ChunkRow:
    if plan is None:
        return ChunkRow(chunk, None, None, None, compiles, None, None, None)
    at_fit = plan_roofline(plan)
    at_prompt = plan_roofline(plan, prompt_tokens=min(prompt_tokens, plan.bounds.input_tokens))
    return ChunkRow(
        chunk,
        value,
        plan.envelope.total,
        next_total,
        compiles,
        at_prompt.ttft_s,
        at_fit.ttft_s,
        at_fit.decode_tokens_per_s,
    )


def best_row(rows: list[ChunkRow]) -> ChunkRow | None:
    """The chunk that fits the most tokens; among equals, the lowest predicted TTFT, then the
    larger chunk (fewer calls)."""
    fitting = [r for r in rows if r.value is not None]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (-r.value, r.ttft_s or 0.0, -r.chunk))


def chunk_doc(rows: list[ChunkRow]) -> list[dict[str, Any]]:
    return [
        {
            "prefill_chunk": r.chunk,
            "value": r.value,
            "m_max": r.m_max,
            "next_value_total": r.next_total,
            "compiles": r.compiles,
            "ttft_s": r.ttft_s,
            "ttft_at_fit_s": r.ttft_at_fit_s,
            "decode_tokens_per_s": r.decode_tokens_per_s,
        }
        for r in rows
    ]


def chunk_table_text(
    rows: list[ChunkRow], letter: str, prompt_tokens: int, profile: str, best: ChunkRow | None
) -> str:
    """The table (ends with a newline). ``letter``: "N" or "M", what was searched."""
    ttft_fit = f"TTFT @ {letter}" if letter == "N" else ""
    lines = [
        f"prefill chunk -> largest {letter}; predicted on {profile} (roofline: a lower bound on time)",
        f"  {'chunk':>6}  {'largest ' + letter:>10}  {'M_max':>12}  "
        f"{'TTFT @ ' + format(prompt_tokens, ','):>14}  {ttft_fit:>12}  {'decode tok/s':>12}",
    ]
    for r in rows:
        mark = "  <- most tokens" if best is not None and r is best else ""
        if r.value is None:
            lines.append(f"  {r.chunk:>6,}  {'none fits':>10}{mark}")
            continue
        lines.append(
            f"  {r.chunk:>6,}  {r.value:>10,}  {human(r.m_max):>12}  "
            f"{seconds_text(r.ttft_s):>14}  "
            f"{seconds_text(r.ttft_at_fit_s) if letter == 'N' else '':>12}  "
            f"{tokens_per_s_text(r.decode_tokens_per_s):>12}{mark}"
        )
    return "\n".join(lines) + "\n"
