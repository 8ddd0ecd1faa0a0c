"""Verifier rule ``fused_kernels``: an ``mx.fast`` op (``schema.fast_ops``) is one MLX would run.

For every ``RMSNorm``, ``RoPE`` and ``ScaledDotProductAttention`` op: its arguments are the
primitive's own (eps a positive float; dims an even int within x's last axis, traditional and
forward bools, base and scale floats; the attention scale a float and its three flags), its inputs
have the shapes and dtypes ``mx.fast`` accepts, its output is the shape and dtype the call makes,
and its ``scratch`` is at least what one call may hold besides its output on the plan's target
(``schema.fast_ops.scratch_bytes``: on the CPU the composite it falls back to), so a plan cannot
claim less memory for a fused op than its fallback takes.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.fast_ops import FUSED, out_shape, problem, scratch_bytes
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]


def fused_kernels(ix: PlanIndex) -> Iterator[Finding]:
    model = ix.plan.target.memory_model
    for px in ix.phases:
        phase = px.phase
        known = px.shapes_and_dtypes()
        for k, op in enumerate(phase.ops):
            if op.primitive not in FUSED:
                continue
            where = px.op_path(k)
            if any(t not in known for t in op.inputs) or len(op.outputs) != 1:
                yield where, f"{op.primitive} needs its inputs defined and one output"
                continue
            shapes = [known[t][0] for t in op.inputs]
            dtypes = [known[t][1] for t in op.inputs]
            why = problem(op.primitive, op.args, shapes, dtypes)
            if why is not None:
                yield where, f"{op.primitive}: {why}"
                continue
            got = known.get(op.outputs[0])
            want = (out_shape(op.primitive, op.args, shapes), dtypes[0])
            if got is not None and got != want:
                yield (
                    f"{where}.outputs",
                    f"{op.primitive} makes {list(want[0])} {want[1]}, the plan records "
                    f"{list(got[0])} {got[1]}",
                )
            need = scratch_bytes(model, op.primitive, shapes, dtypes, op.args)
            if op.scratch < need:
                target = model.name if model is not None else "the CPU (its composite fallback)"
                yield (
                    f"{where}.scratch",
                    f"{op.scratch}, but one {op.primitive} call may hold {need} bytes besides its "
                    f"output on {target}",
                )
