"""Verifier rule ``gpu_qmm``: a GPU plan charges each quantised matmul what its kernels allocate.

For a plan with a GPU ``target.memory_model``, every ``QuantizedMatmul`` op's ``scratch`` is at
least what MLX's kernels for its shapes may allocate besides the output, as the allocator counts it
(``schema.gpu_qmm``, MLX 0.32.1's source): on Metal the split-K partial sums of ``qmm_splitk`` and
``qvm_split_k`` (the device's qmv batch limit at its lowest over Apple's GPUs, both readings of the
row count); on CUDA the transposed scales and biases ``qmm_sm90`` copies on H100-class GPUs. The
contiguous copies of its inputs, which depend on layouts the plan does not record, are the
compiler's to add.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.gpu_qmm import gpu_qmm_scratch
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]


def gpu_qmm(ix: PlanIndex) -> Iterator[Finding]:
    model = ix.plan.target.memory_model
    if model is None:
        return
    for px in ix.phases:
        phase = px.phase
        known = px.shapes_and_dtypes()
        for k, op in enumerate(phase.ops):
            if op.primitive != "QuantizedMatmul" or len(op.args) < 4 or len(op.outputs) != 1:
                continue
            if any(t not in known for t in (*op.inputs, op.outputs[0])):
                continue  # bindings: another rule's finding
            shapes = [known[t][0] for t in op.inputs]
            dtypes = [known[t][1] for t in op.inputs]
            need = gpu_qmm_scratch(model, shapes, dtypes, known[op.outputs[0]][0], op.args)
            if op.scratch < need:
                what = "split-K partial sums" if model.name == "metal" else "transposed scales"
                yield (
                    f"{px.op_path(k)}.scratch",
                    f"{op.scratch}, but {model.name}'s quantised matmul of these shapes may hold "
                    f"{need} bytes ({what})",
                )
