"""Bytes a vision call holds only while it runs: its own per-call inputs (the image's pixel
values and its row), counted with that phase's arena rather than as persistent state.

The runner makes them for one vision call, waits for the call and drops them before the next
(``runner.vision_session``); the features table, also an input of every vision call, lives across
calls and is counted with prefill's inputs (persistent): once in a serial plan, twice overlapped."""

from __future__ import annotations

import math

from dctms.schema.sizes import ITEMSIZE

TABLE = "image_features"


def vision_phases(plan) -> set[str]:
    """The names of the plan's vision phases (its vision variants); empty in a text plan."""
    return {v.phase for v in plan.vision.variants} if plan.vision is not None else set()


def call_input_bytes(phase, slack: int) -> int:
    """A vision call's own inputs (all but the table), each with the allocator's reuse slack."""
    sizes = [
        math.prod(b.shape) * ITEMSIZE.get(b.dtype, 0)
        for b in phase.inputs
        if b.kind == "input" and b.name != TABLE
    ]
    return sum(s + min(s, slack) for s in sizes)


def transient_bytes(plan, phase) -> int:
    """What a phase's call holds besides its arena and slack: a vision call's own inputs."""
    if phase.name not in vision_phases(plan):
        return 0
    return call_input_bytes(phase, plan.target.allocator_slack)


def intermediate_need(plan) -> int:
    """M_intermediate a vision-language plan needs: the largest phase call (arena, slack, a vision
    call's own inputs) when its streams take turns; with ``vision.overlap`` one call of each
    stream at once: the largest text call plus the largest vision call."""
    calls = {p.name: p.arena_bytes + p.slack_bytes + transient_bytes(plan, p) for p in plan.phases}
    variants = vision_phases(plan)
    if plan.vision is None or not plan.vision.overlap:
        return max(calls.values(), default=0)
    text = max((b for n, b in calls.items() if n not in variants), default=0)
    return text + max((b for n, b in calls.items() if n in variants), default=0)


def input_copies(plan, phase, binding) -> int:
    """How many of a runner phase's input arrays are alive at once (persistent state): two calls'
    (one computing, one being built), but one features table in a serial plan. There every image is
    encoded and waited for before prefill, and every prefill call reads that same array; a vision
    call's new table is its arena's output. Overlapped, a prefill call still computing may read the
    old table while the new one (its vision call done) is already fed to the next: two."""
    serial = plan.vision is not None and not plan.vision.overlap
    return 1 if serial and phase.name == "prefill" and binding.name == TABLE else 2
