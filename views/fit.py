"""``dctms fit``'s search and report: the largest N (or M) whose M_max fits a memory budget.

The search is over an opaque ``measure(value) -> M_max`` (one compile each), so it is pure and can be
tested without compiling. It assumes M_max does not shrink as N or M grows, which holds for the
compiler's plans (KV capacity and prefill shapes only grow), and it always ends with a certificate:
the answer was compiled and fits, and answer + 1 was compiled and does not (unless capped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dctms.figures.overview import PARTS_RULE
from dctms.figures.units import MIB, human
from dctms.schema.types import Plan

DEFAULT_CAP = 2**20  # when the config names no max_position_embeddings


@dataclass(frozen=True)
class Probe:
    value: int
    total: int  # M_max in bytes
    fits: bool


@dataclass
class FitResult:
    budget: int
    cap: int
    best: int | None = None  # largest value that fits; None when even 1 does not
    probes: list[Probe] = field(default_factory=list)  # in the order they were compiled

    @property
    def capped(self) -> bool:
        """The search stopped at the cap, not at the budget."""
        return self.best == self.cap

    def probe(self, value: int) -> Probe | None:
        return next((p for p in self.probes if p.value == value), None)


def largest_fitting(
    measure: Callable[[int], int], budget: int, cap: int, hint: int | None = None
) -> FitResult:
    """The largest value in [1, cap] whose ``measure`` fits ``budget``, never measuring a value twice.

    ``hint`` (a nearby answer, e.g. the previous chunk's) is measured first, else 1 (when nothing
    fits, 1 was measured, so "even 1 does not fit" is certain). Then a bracket [lo fits, hi does
    not] is grown from there by doubling or a jump to the linear estimate of the crossing, and
    closed by interpolating where M_max crosses the budget: M_max is close to linear in N and M,
    so the crossing is usually found in a few compiles. An interpolation step that does not halve
    the bracket is followed by a bisection step, so the search is never worse than about twice
    plain bisection: at most ~4 log2(cap) calls."""
    result = FitResult(budget=budget, cap=cap)
    seen: dict[int, int] = {}

    def total(value: int) -> int:
        if value not in seen:
            seen[value] = measure(value)
            result.probes.append(Probe(value, seen[value], seen[value] <= budget))
        return seen[value]

    if cap < 1:
        return result
    lo, hi = 1, None  # lo fits; hi (once known) does not
    if hint is not None and 1 < hint <= cap and total(hint) <= budget:
        lo = hint  # so 1 fits too (M_max does not shrink as the value grows)
    elif total(1) > budget:
        return result
    elif hint is not None and 1 < hint <= cap:
        hi = hint  # [1, hint] is a bracket already
    while hi is None:  # grow: at least double, or jump to the linear estimate of the crossing
        if lo == cap:
            result.best = lo
            return result
        nxt = min(cap, max(2 * lo, _crossing(seen, lo, budget)))
        if total(nxt) <= budget:
            lo = nxt
        else:
            hi = nxt
    interpolate = True
    while hi - lo > 1:  # invariant: lo fits, hi does not
        if interpolate:
            t_lo, t_hi = seen[lo], seen[hi]
            guess = lo + (budget - t_lo) * (hi - lo) // max(t_hi - t_lo, 1)
            mid = min(max(guess, lo + 1), hi - 1)
        else:
            mid = (lo + hi) // 2
        width = hi - lo
        if total(mid) <= budget:
            lo = mid
        else:
            hi = mid
        interpolate = not interpolate or 2 * (hi - lo) <= width
    result.best = lo
    return result


def _crossing(seen: dict[int, int], lo: int, budget: int) -> int:
    """Where the line through the two largest measured fitting values reaches ``budget``, a little
    past it so the bracket usually closes in one step (0 when there is no such line)."""
    below = sorted(v for v, t in seen.items() if v <= lo and t <= budget)
    if len(below) < 2:
        return 0
    a, b = below[-2], below[-1]
    slope = (seen[b] - seen[a]) / (b - a)
    if slope <= 0:
        return 0
    estimate = b + (budget - seen[b]) / slope
    return int(estimate * 1.02) + 1


def max_positions(config: dict) -> int | None:
    """``max_position_embeddings`` of a config (or of its ``text_config``), when it has one."""
    for where in (config, config.get("text_config") or {}):
        value = where.get("max_position_embeddings") if isinstance(where, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def fit_summary(result: FitResult, plan: Plan, searched: str, elapsed: float) -> dict[str, Any]:
    """The figures at the fit, JSON-ready. ``searched``: "input_tokens" or "output_tokens"."""
    e = plan.envelope
    over = None if result.best is None else result.probe(result.best + 1)
    return {
        "searched": searched,
        "value": result.best,
        "input_tokens": plan.bounds.input_tokens,
        "output_tokens": plan.bounds.output_tokens,
        "batch": plan.bounds.batch,
        "prefill_chunk": plan.bounds.prefill_chunk,
        "budget": result.budget,
        "envelope": {
            "weights": e.weights,
            "kv": e.kv,
            "persistent": e.persistent,
            "intermediate": e.intermediate,
            "runtime": e.runtime,
            "total": e.total,
            "free": result.budget - e.total,
        },
        **({"parts": msgspec.to_builtins(e.parts)} if e.parts else {}),
        "capped": result.capped,
        "cap": result.cap,
        "next_value_total": None if over is None else over.total,
        "compiles": len(result.probes),
        "seconds": round(elapsed, 2),
        "probes": [{"value": p.value, "m_max": p.total, "fits": p.fits} for p in result.probes],
    }


def fit_text(summary: dict[str, Any], model: str, cap_reason: str) -> str:
    """What ``dctms fit`` prints (ends with a newline)."""
    letter = "N" if summary["searched"] == "input_tokens" else "M"
    other = "M" if letter == "N" else "N"
    fixed = summary["output_tokens"] if letter == "N" else summary["input_tokens"]
    value, budget = summary["value"], summary["budget"]
    lines = [
        f"{model}: largest {letter} = {value:,} for {other} = {fixed:,} within {human(budget)}"
        f" ({budget:,} bytes)"
    ]
    if summary["capped"]:
        lines.append(f"  stopped at {cap_reason}; the budget would allow more")
    elif summary["next_value_total"] is not None:
        over = summary["next_value_total"] - budget
        lines.append(
            f"  {letter} = {value + 1:,} needs M_max {summary['next_value_total']:,} bytes, "
            f"{human(over)} ({over:,} bytes) over"
        )
    env = summary["envelope"]
    rows = [
        ("weights", env["weights"]),
        ("kv", env["kv"]),
        ("persistent", env["persistent"]),
        ("intermediate", env["intermediate"]),
        ("runtime", env["runtime"]),
        ("total = M_max", env["total"]),
        ("device", budget),
        ("free", env["free"]),
    ]
    lines += [
        "",
        f"at N = {summary['input_tokens']:,}, M = {summary['output_tokens']:,}, "
        f"batch {summary['batch']}, prefill chunk {summary['prefill_chunk']}",
        f"{'memory envelope':<20} {'bytes':>18} {'MiB':>12}",
    ]
    lines += [f"  {name:<18} {v:>18,} {v / MIB:>12,.2f}" for name, v in rows]
    for part in summary.get("parts", []):  # a speculative plan: each model's share
        share = sum(part[k] for k in ("weights", "kv", "persistent", "intermediate"))
        lines.append(
            f"  {part['model'] + ' part':<18} {share:>18,} {share / MIB:>12,.2f}  (weights "
            f"{part['weights']:,}, kv {part['kv']:,}, persistent {part['persistent']:,}, "
            f"intermediate {part['intermediate']:,})"
        )
    if summary.get("parts"):
        lines.append(f"  ({PARTS_RULE})")
    lines += [
        "",
        f"{summary['compiles']} compiles in {summary['seconds']:.1f} s "
        f"({'up to the cap' if summary['capped'] else 'estimate, then interpolation / bisection'}; "
        f"assumes M_max never shrinks as {letter} grows)",
    ]
    return "\n".join(lines) + "\n"
