"""A batched plan's slot move (``move_slot``): one slot's KV row copied into another.

A decode step computes the rows up to the highest busy slot (``toolkit.slots``). When the sequences
in low slots end while one in a high slot keeps generating, every later step would still compute
the idle rows below it. The runner (``runner.batch``) moves that sequence into the lowest free slot
instead: every KV array's row ``source`` is written to row ``slot`` (a ``DynamicSlice`` of the row,
then a ``DynamicSliceUpdate`` on axis 0). The row's bytes are the same bytes, so the sequence goes
on generating exactly what it would have generated in its old slot, and the steps after the move
compute only the busy rows.

Memory: each row is read, then written into the array it came from, which MLX does in place only
if the read has finished (``toolkit.schedule.donation_cuts`` puts a sync point after each read);
and each array's row is read only after the previous array is written (an ``mx.depends`` on its
start), so at most two rows are alive at once, whatever the number of layers (without it, MLX's
breadth-first order read about twenty rows ahead: 70 MB of a 4,353-position SmolLM2 plan).

Both starts are a single value on axis 0 fed by the runner below ``bounds.batch``; the verifier
bounds them (``schema.rules_index``) and accepts the whole-row write only in this phase
(``schema.access``). The phase processes no token; its ``tokens`` is 1, the least a phase
may claim.
"""

from __future__ import annotations

import mlx.core as mx

from dctms.schema.slotted import MOVE_PHASE as MOVE
from dctms.toolkit.trace import PhaseTracer, TracedPhase, _export

FEEDS = ("slot", "source")  # the row written, the row read


def trace_move_phase(tracer: PhaseTracer) -> TracedPhase:
    """``move_slot`` over every KV array of the tracer's batched state."""
    names = [a.name for a in tracer.layout.arrays]
    state = {n: tracer.state[n] for n in names}
    feeds = {name: mx.array(0, mx.int32) for name in FEEDS}

    def move(slot, source, **kw):
        out = []
        start = source.reshape(1)
        for n in names:
            _, heads, capacity, dim = kw[n].shape
            size = (1, heads, capacity, dim)
            row = mx.slice(kw[n], start, axes=(0,), slice_size=size)
            out.append(mx.slice_update(kw[n], row, slot.reshape(1), axes=(0,)))
            # the next array's row is read only once this one is written: one row at a time
            start = mx.depends(source.reshape(1), out[-1])
        return tuple(out)

    return _export(MOVE, 1, move, feeds, {}, state, names, results=())
