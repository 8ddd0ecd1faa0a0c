"""The structure of a packing instance, for explaining an arena above its lower bound.

A compiled phase repeats its decoder layer: its tenants' lifetimes come back shifted by one layer's
slots (the *period*), and the live bytes reach the lower bound in many layers, so every one of
those peaks must be packed without a hole for the arena to meet the bound. ``structure`` measures
that: the period and how many buffers repeat with it, how many periods reach the bound, the most
buffers live at once, whether time splits into independent parts, and how a window of two periods
packs on its own (with the same budget). A window that packs at its own bound while the whole phase
does not says the bound is not what stops the packer there: the size of the search is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from dctms.toolkit.pack.problem import Problem, live_max, make_problem, sweep
from dctms.toolkit.pack.solve import solve

# Shifts tried as the period: the most frequent gaps between starts of same-shaped buffers.
_PERIOD_CANDIDATES = 8


@dataclass(frozen=True)
class Structure:
    buffers: int
    parts: int  # independent parts (no buffer crosses between them)
    live_at_once: int  # most buffers live at once
    period: int | None  # slots between a buffer and its copy one layer later (None: no repeat)
    periodic: int  # buffers whose copy shifted by the period is in the instance too
    peak_periods: int  # periods in which the live bytes reach the lower bound
    window_buffers: int  # buffers of a window of two periods in the middle (clipped to it)
    window_ratio: float  # that window packed alone: arena / its own lower bound
    window_greedy: float  # its greedy arena / its own lower bound

    def describe(self) -> str:
        if self.period is None:
            return (
                f"{self.buffers} buffers, {self.parts} part(s), up to {self.live_at_once} live "
                "at once, no period"
            )
        return (
            f"{self.parts} part(s) of {self.buffers} buffers, up to {self.live_at_once} live at "
            f"once; period {self.period} slots ({self.periodic} buffers repeat with it), the live "
            f"bytes reach the bound in {self.peak_periods} periods; a two-period window "
            f"({self.window_buffers} buffers) packs alone at {self.window_ratio:.4f} x its own "
            f"bound (greedy {self.window_greedy:.4f})"
        )


def period(p: Problem) -> tuple[int | None, int]:
    """The shift that maps the most buffers onto a buffer of the same size and length, and how
    many it maps (None, 0 when no shift maps any)."""
    starts: dict[tuple[int, int], list[int]] = {}
    for s, e, z in zip(p.start.tolist(), p.end.tolist(), p.size.tolist(), strict=True):
        starts.setdefault((z, e - s), []).append(s)
    gaps: Counter[int] = Counter()
    for v in starts.values():
        v.sort()
        gaps.update(b - a for a, b in zip(v, v[1:], strict=False) if b > a)
    present = set(zip(p.start.tolist(), p.end.tolist(), p.size.tolist(), strict=True))
    best, matched = None, 0
    for shift, _ in sorted(gaps.most_common(_PERIOD_CANDIDATES), key=lambda kv: (-kv[1], kv[0])):
        n = sum((s + shift, e + shift, z) in present for s, e, z in present)
        if n > matched:
            best, matched = shift, n
    return best, matched


def structure(p: Problem, seconds: float) -> Structure:
    """See the module docstring; ``seconds`` is the window's packing budget."""
    sw = sweep(p)
    bound = live_max(p)
    points = np.unique(np.concatenate((p.start, p.end)))
    live_bytes = np.zeros(points.size, dtype=np.int64)
    live_count = np.zeros(points.size, dtype=np.int64)
    np.add.at(live_bytes, sw.sec_lo, p.size)
    np.add.at(live_bytes, sw.sec_hi, -p.size)
    np.add.at(live_count, sw.sec_lo, 1)
    np.add.at(live_count, sw.sec_hi, -1)
    live_bytes, live_count = np.cumsum(live_bytes), np.cumsum(live_count)
    shift, matched = period(p)
    if shift is None:
        return Structure(p.n, len(sw.parts), int(live_count.max()), None, 0, 0, 0, 0.0, 0.0)
    t0 = int(p.start.min())
    peaks = {int((t - t0) // shift) for t in points[live_bytes == bound].tolist()}
    # The window: two periods from the least crowded point of the period before the middle.
    middle = (t0 + int(p.end.max())) // 2
    near = (points >= middle - shift) & (points < middle)
    a = int(points[near][np.argmin(live_bytes[near])]) if near.any() else middle
    z = a + 2 * shift
    inside = (p.start < z) & (p.end > a)
    window = make_problem(
        np.maximum(p.start[inside], a),
        np.minimum(p.end[inside], z),
        p.size[inside],
        p.align[inside],
    )
    packed = solve(window, seconds)
    return Structure(
        buffers=p.n,
        parts=len(sw.parts),
        live_at_once=int(live_count.max()),
        period=shift,
        periodic=matched,
        peak_periods=len(peaks),
        window_buffers=window.n,
        window_ratio=packed.arena / packed.lower_bound,
        window_greedy=packed.greedy_arena / packed.lower_bound,
    )
