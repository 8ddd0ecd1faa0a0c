"""Packing problems whose optimum is known by construction (for benchmarks and tests).

``tiles(n, seed)`` cuts a ``width`` x ``span`` rectangle (bytes x time) into ``n`` random tiles by
guillotine cuts; each tile is a buffer live over its time range with its byte height as size. The
tiles fill the rectangle exactly, so ``width`` bytes are live at every time: the lower bound is
``width`` and the tiles' own offsets reach it, so the optimal arena is exactly ``width``.
"""

from __future__ import annotations

import random

from dctms.toolkit.pack.problem import Problem, make_problem


def tiles(
    n: int, seed: int = 0, width: int = 1 << 20, span: int = 10_000, align: int = 64
) -> tuple[Problem, list[int]]:
    """The problem and the offsets of its construction (an optimal packing)."""
    rng = random.Random(seed)
    # (byte_lo, byte_hi, t_lo, t_hi); byte cuts on multiples of ``align``.
    pieces = [(0, width, 0, span)]
    while len(pieces) < n:
        k = rng.randrange(len(pieces))
        y0, y1, t0, t1 = pieces[k]
        can_bytes = (y1 - y0) // align >= 2
        can_time = t1 - t0 >= 2
        if not (can_bytes or can_time):
            continue
        if can_bytes and (not can_time or rng.random() < 0.5):
            cut = y0 + align * rng.randrange(1, (y1 - y0) // align)
            pieces[k : k + 1] = [(y0, cut, t0, t1), (cut, y1, t0, t1)]
        else:
            cut = rng.randrange(t0 + 1, t1)
            pieces[k : k + 1] = [(y0, y1, t0, cut), (y0, y1, cut, t1)]
    rng.shuffle(pieces)
    problem = make_problem(
        [t0 for _, _, t0, _ in pieces],
        [t1 for _, _, _, t1 in pieces],
        [y1 - y0 for y0, y1, _, _ in pieces],
        align,
    )
    return problem, [y0 for y0, _, _, _ in pieces]
