"""Verifier rule ``donation``: an op output that aliases an input's buffer is one MLX makes so.

A view (``view_of`` set, not a state update) is made either by a view primitive
(``schema.aliasing.VIEW_ALWAYS``, ``RESHAPES``, mlx.distributed's ``Send``) or by an elementwise
primitive writing into a *donated* input (``DONATING``). MLX donates only an input nothing else
holds (``schema.aliasing``), so for a donated output the plan itself must show that:

- the op has one output, which is not a phase output, and reads the donated buffer through exactly
  one input, the *donor*: the root tensor, or an output donated to earlier;
- the donor is a tensor of this phase (an input binding or constant is held by the runner), read by
  this op alone and only once, not a phase output and in no sync point's ``evaluate`` list;
- the donor's producer has one output and runs in the same segment (between the same sync points)
  as this op;
- the donor and the output have the same itemsize, and the root's bytes exceed the output's by at
  most ``DONATION_SLACK_BYTES``.

Whether the donor's *layout* lets MLX donate is the compiler's memory model (strides are not in
the plan); the op-allocation audit (tests/test_op_allocations.py) checks that MLX does.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from dctms.schema.aliasing import (
    DONATING,
    DONATION_SLACK_BYTES,
    IN_PLACE,
    RESHAPES,
    VIEW_ALWAYS,
)
from dctms.schema.phase_index import PhaseIndex, PlanIndex
from dctms.schema.sizes import ITEMSIZE

Finding = tuple[str, str]

VIEW_PRIMITIVES = VIEW_ALWAYS | RESHAPES | {"Send"}


def donation(ix: PlanIndex) -> Iterator[Finding]:
    for px in ix.phases:
        yield from _phase_donation(px)


def _phase_donation(px: PhaseIndex) -> Iterator[Finding]:
    phase = px.phase
    tensors = phase.tensors
    held = {b.id for b in phase.outputs}
    for sp in phase.sync_points:
        held.update(sp.evaluate)
    segment = _segments(px)
    for i, t in enumerate(tensors):
        if t.view_of is None or t.kind == "state":
            continue
        producer = px.producer.get(t.id)
        if producer is None:
            continue  # interval_producer reports it
        op = phase.ops[producer]
        if op.primitive in VIEW_PRIMITIVES:
            continue
        where = f"{px.tensor_path(i)}.view_of"
        if op.primitive not in DONATING:
            yield (
                where,
                f"op {producer} ({op.primitive}) writes a new buffer: its output cannot alias {t.view_of!r}",
            )
            continue
        problem = _donation_problem(px, t, producer, held, segment)
        if problem:
            yield (
                where,
                f"op {producer} ({op.primitive}) cannot write into {t.view_of!r}: {problem}",
            )


def _segments(px: PhaseIndex):
    """The segment (between two sync points) each op position of the phase runs in."""
    sync_slots = sorted(sp.slot for sp in px.phase.sync_points)

    def segment(position: int) -> int:
        return bisect.bisect_left(sync_slots, px.slot_of.get(position, -1))

    return segment


def _donation_problem(px: PhaseIndex, t, producer: int, held: set[str], segment) -> str:
    phase = px.phase
    tensors = phase.tensors
    op = phase.ops[producer]
    if len(op.outputs) != 1:
        return "an op with several outputs never takes an input's buffer"
    if t.id in held:
        return "the output is a phase output or evaluated at a sync point"
    donors = [x for x in op.inputs if x == t.view_of or _donated_to(px, x, t.view_of)]
    if not donors:
        return "it reads neither that tensor nor an output donated from it"
    if len(donors) > 1:
        return f"it reads the buffer through {len(donors)} inputs"
    donor = donors[0]
    at = px.tensor_at.get(donor)
    if at is None:
        return f"the donor {donor!r} is an input or constant the runner holds"
    reads = px.consumers.get(donor, [])
    if len(reads) != 1:
        return f"the donor {donor!r} is read {len(reads)} times (MLX donates a sole read only)"
    if donor in held:
        return f"the donor {donor!r} is a phase output or evaluated at a sync point"
    made = px.producer.get(donor)
    if made is None or len(phase.ops[made].outputs) != 1:
        return f"the donor {donor!r} is not the only output of its op"
    if segment(made) != segment(producer):
        return f"the donor {donor!r} is made before a sync point this op runs after"
    root = tensors[px.tensor_at[t.view_of]] if t.view_of in px.tensor_at else None
    if root is None:
        return f"{t.view_of!r} is not a tensor of this phase"
    if ITEMSIZE.get(tensors[at].dtype) != ITEMSIZE.get(t.dtype):
        return f"the donor is {tensors[at].dtype} and the output {t.dtype} (MLX donates equal itemsizes)"
    if root.bytes > t.bytes + DONATION_SLACK_BYTES:
        return (
            f"the buffer ({root.bytes} bytes) exceeds the output ({t.bytes}) by more than "
            f"{DONATION_SLACK_BYTES}"
        )
    return ""


def _donated_to(px: PhaseIndex, x: str, root: str) -> bool:
    """Whether ``x`` is an output donated into ``root``'s buffer (a view made by a donating op)."""
    at = px.tensor_at.get(x)
    if at is None or px.phase.tensors[at].view_of != root:
        return False
    made = px.producer.get(x)
    return made is not None and px.phase.ops[made].primitive in DONATING


def state_in_place(ix: PlanIndex) -> Iterator[Finding]:
    """A state array updated in place is read by no other op of its phase, unless that read ends at
    a sync point before the update (``toolkit.schedule.donation_cuts``): MLX decides whether the
    update may take the array's buffer when it schedules it, and a read still queued holds the
    buffer, so the update would copy the whole array, bytes the envelope does not count."""
    for px in ix.phases:
        phase = px.phase
        state = {b.id: b.name for b in phase.inputs if b.kind == "state"}
        segment = _segments(px)
        for t, name in state.items():
            readers = px.consumers.get(t, [])
            writers = [
                k for k in readers
                if phase.ops[k].primitive in IN_PLACE and phase.ops[k].inputs[:1] == [t]
            ]  # fmt: skip
            for w in writers:
                for r in readers:
                    if r == w:
                        continue
                    if px.slot_of.get(r, -1) > px.slot_of.get(w, -1):
                        problem = "after it"
                    elif segment(r) == segment(w):
                        problem = "in the same segment (no sync point between them)"
                    else:
                        continue
                    yield (
                        px.op_path(r),
                        f"op {r} ({phase.ops[r].primitive}) reads state {name!r} {problem} as op "
                        f"{w} ({phase.ops[w].primitive}) updates it in place: MLX would copy the "
                        "whole array",
                    )
                    break
