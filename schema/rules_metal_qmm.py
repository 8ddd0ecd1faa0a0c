"""Verifier rule ``metal_qmm``: a Metal plan charges each quantised matmul its split-K partials.

For a plan whose ``target.memory_model`` is Metal's, every ``QuantizedMatmul`` op's ``scratch`` is
at least the partial sums MLX's Metal kernels for its shapes may allocate (``qmm_splitk`` and
``qvm_split_k``, mlx/backend/metal/quantized.cpp v0.32.1), as the allocator counts them
(``schema.metal_qmm``: the device's qmv batch limit at its lowest over Apple's GPUs, both
readings of the row count). The contiguous copies of its inputs, which depend on layouts the plan
does not record, are the compiler's to add.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.metal_qmm import metal_qmm_scratch
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]


def metal_qmm(ix: PlanIndex) -> Iterator[Finding]:
    model = ix.plan.target.memory_model
    if model is None or model.name != "metal":
        return
    for px in ix.phases:
        phase = px.phase
        known = {t.id: (tuple(t.shape), t.dtype) for t in phase.tensors}
        known.update({b.id: (tuple(b.shape), b.dtype) for b in phase.inputs})
        known.update({c.id: (tuple(c.shape), c.dtype) for c in phase.constants})
        for k, op in enumerate(phase.ops):
            if op.primitive != "QuantizedMatmul" or len(op.args) < 4 or len(op.outputs) != 1:
                continue
            if any(t not in known for t in (*op.inputs[:2], op.outputs[0])):
                continue  # bindings: another rule's finding
            shapes = [known[t][0] for t in op.inputs[:2]]
            out, dtype = known[op.outputs[0]][0], known[op.inputs[0]][1]
            need = metal_qmm_scratch(model, shapes, out, dtype, op.args)
            if op.scratch < need:
                yield (
                    f"{px.op_path(k)}.scratch",
                    f"{op.scratch}, but Metal's split-K quantised matmul of these shapes may "
                    f"hold {need} bytes of partial sums",
                )
