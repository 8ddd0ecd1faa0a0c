"""``dctms fit``'s search and report: the largest N (or M) whose M_max fits a memory budget.

The search is over an opaque ``measure(value) -> M_max`` (one compile each), so it is pure and can be
tested without compiling. It assumes M_max does not shrink as N or M grows, which holds for the
compiler's plans (KV capacity and prefill shapes only grow), and it always ends with a certificate:
the answer was compiled and fits, and answer + 1 was compiled and does not (unless capped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dctms.figures.overview import PARTS_RULE
from dctms.figures.units import MIB, human
from dctms.schema.types import Plan

DEFAULT_CAP = 2**20  # when the config names no max_position_embeddings


@dataclass(frozen=True)
class Probe:
    value: int  # the value compiled
    total: int  # M_max in bytes
    fits: bool
    first: int = 0  # the smallest value that compiles alike (0: ``value`` alone)

    def covers(self, value: int) -> bool:
        return (self.first or self.value) <= value <= self.value


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
        """The probe whose compile holds for ``value`` (it, or a value that compiles alike)."""
        return next((p for p in self.probes if p.covers(value)), None)


# The values that compile to the same M_max as a given one: (first, last), an interval around it.
Extent = Callable[[int], tuple[int, int]]


def largest_fitting(
    measure: Callable[[int], int],
    budget: int,
    cap: int,
    hint: int | Sequence[int] | None = None,
    step: int = 1,
    extent: Extent | None = None,
) -> FitResult:
    """The largest value in [1, cap] whose ``measure`` fits ``budget``, never measuring a value twice.

    ``hint`` (a nearby answer, e.g. the previous chunk's; or several, tried in order until one
    fits) is measured first, else 1 (when nothing fits, 1 was measured, so "even 1 does not fit"
    is certain). Then a bracket [lo fits, hi does
    not] is grown from there by doubling or a jump to the linear estimate of the crossing, and
    closed by interpolating where M_max crosses the budget: M_max is close to linear in N and M,
    so the crossing is usually found in a few compiles. An interpolation step that does not halve
    the bracket is followed by a bisection step, so the search is never worse than about twice
    plain bisection: at most ~4 log2(cap) calls.

    ``extent(v)``, when given, is the interval of values that compile to the same plan as ``v``
    (the compiler's ``length_key``): one compile, of the interval's last value, answers for all of
    it, so a fitting probe moves ``lo`` to the interval's end and a failing one ``hi`` to its start.
    ``step`` puts the probes on multiples of it while the bracket is wider (M_max jumps where the
    padded prompt grows a chunk: probing the tops of the chunks first finds the jump in a few
    compiles, where interpolation across it would creep), and once the answer is within the chunk
    above a multiple that fits, probes the value just past it first. Neither changes the answer."""
    result = FitResult(budget=budget, cap=cap)
    if cap < 1:
        return result
    lo, hi = 0, None  # lo fits (0: nothing yet); hi (once known) does not

    def probe(value: int) -> bool:
        nonlocal lo, hi
        known = result.probe(value)
        if known is None:
            first, last = extent(value) if extent is not None else (value, value)
            first, last = max(first, 1), min(last, cap)
            total = measure(last)
            known = Probe(last, total, total <= budget, first if first < last else 0)
            result.probes.append(known)
        if known.fits:
            lo = max(lo, known.value)
        else:
            start = known.first or known.value
            hi = start if hi is None else min(hi, start)
        return known.fits

    def total(value: int) -> int:
        found = result.probe(value)
        assert found is not None
        return found.total

    hints = [] if hint is None else [hint] if isinstance(hint, int) else list(hint)
    fitted = False
    for h in hints:  # in order, until one fits (one at or above a failed one cannot)
        if 1 < h <= cap and (hi is None or h < hi) and probe(h):
            fitted = True
            break
    if not fitted and not probe(1):
        return result
    while hi is None:  # grow: at least double, or jump to the linear estimate of the crossing
        if lo >= cap:
            result.best = cap
            return result
        nxt = min(cap, max(2 * lo, _crossing(result.probes, lo, budget)))
        probe(_on_grid(nxt, lo, cap + 1, step))
    interpolate, tried_next = True, False
    while hi - lo > 1:  # invariant: lo fits, hi does not
        if interpolate:
            t_lo, t_hi = total(lo), total(hi)
            guess = lo + (budget - t_lo) * (hi - lo) // max(t_hi - t_lo, 1)
        else:
            guess = (lo + hi) // 2
        width = hi - lo
        mid = _on_grid(min(max(guess, lo + 1), hi - 1), lo, hi, step)
        # just past a chunk top, where M_max jumps: often the answer's + 1 (not counted as a
        # stalled interpolation: the next guess is interpolated from the far side of the jump)
        jump = step > 1 and lo % step == 0 and mid < lo + step
        fitted = probe(lo + 1 if jump else mid)
        if jump:
            continue
        if interpolate and fitted and hi - lo > 1 and not tried_next:
            # M_max is close to affine between lo and hi: the interpolated value that fits is
            # usually the answer, and its + 1 the certificate (once: where the guesses fall
            # short, bisection takes over as before)
            tried_next = True
            probe(lo + 1)
            continue
        interpolate = not interpolate or 2 * (hi - lo) <= width
    result.best = lo
    return result


def _on_grid(value: int, lo: int, hi: int, step: int) -> int:
    """The multiple of ``step`` strictly between ``lo`` and ``hi`` nearest below ``value``;
    ``value`` itself when there is none (the bracket is then within one step: probing the value
    finds the jump directly)."""
    below = value // step * step
    return below if step > 1 and lo < below < hi else value


def _crossing(probes: list[Probe], lo: int, budget: int) -> int:
    """Where the line through the two largest measured fitting values reaches ``budget``, a little
    past it so the bracket usually closes in one step (0 when there is no such line)."""
    below = sorted((p.value, p.total) for p in probes if p.value <= lo and p.fits)
    if len(below) < 2:
        return 0
    (a, t_a), (b, t_b) = below[-2], below[-1]
    slope = (t_b - t_a) / (b - a)
    if slope <= 0:
        return 0
    estimate = b + (budget - t_b) / slope
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
        # the value compiled for it: the next value or one with the same plan (the same length key)
        "next_value_compiled_as": None if over is None else over.value,
        "compiles": len(result.probes),
        "seconds": round(elapsed, 2),
        "probes": [
            {"value": p.value, "first": p.first or p.value, "m_max": p.total, "fits": p.fits}
            for p in result.probes
        ],
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
        alike = summary.get("next_value_compiled_as")
        if alike is not None and alike != value + 1:
            lines.append(
                f"  (compiled as {letter} = {alike:,}: the same prefill chunk, KV capacity and "
                "padded prompt, so the same plan)"
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
        f"{summary['compiles']} compile{'s' if summary['compiles'] != 1 else ''} in "
        f"{summary['seconds']:.1f} s "
        f"({'up to the cap' if summary['capped'] else 'estimate, then interpolation / bisection'}; "
        f"assumes M_max never shrinks as {letter} grows)",
    ]
    return "\n".join(lines) + "\n"
