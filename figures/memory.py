"""A phase's memory over time: the live-bytes curve, its peak, and the tenants live at a slot.

The curve is ``schema.sizes.arena_curve`` (the sweep the lower bound maximises), so its peak is the
plan's ``lower_bound_bytes`` by construction.
"""

from __future__ import annotations

from dctms.schema.sizes import align_up, arena_curve, is_arena_tenant
from dctms.schema.types import Phase, Tensor


def memory_curve(phase: Phase, alignment: int) -> list[int]:
    """Live bytes per slot: the aligned bytes of every arena tenant whose interval holds the slot."""
    return arena_curve(phase.tensors, len(phase.slots), alignment)


def peak(curve: list[int]) -> tuple[int, int]:
    """(first slot where live bytes are highest, those bytes); (0, 0) for an empty phase."""
    if not curve:
        return 0, 0
    best = max(curve)
    return curve.index(best), best


def live_at(phase: Phase, slot: int, alignment: int) -> list[Tensor]:
    """Arena tenants live in ``slot``, largest (aligned) first, then by id: the buffers at a peak."""
    live = [
        t for t in phase.tensors if is_arena_tenant(t) and t.interval[0] <= slot <= t.interval[1]
    ]
    live.sort(key=lambda t: (-align_up(t.bytes, alignment), t.id))
    return live
