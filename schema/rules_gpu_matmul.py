"""Verifier rule ``gpu_matmul``: a GPU plan charges each matmul what its kernels allocate.

For a plan with a GPU ``target.memory_model``, every ``QuantizedMatmul``, ``Matmul`` and ``AddMM``
op's ``scratch`` is at least what MLX's kernels for its shapes may allocate besides the output, as
the allocator counts it (MLX 0.32.1's source): for a quantised matmul (``schema.gpu_qmm``) on Metal
the split-K partial sums of ``qmm_splitk`` and ``qvm_split_k`` (the device's qmv batch limit at its
lowest over Apple's GPUs, both readings of the row count), on CUDA the transposed scales and biases
``qmm_sm90`` copies on H100-class GPUs; for an unquantised one on Metal (``schema.gpu_matmul``) the
split-K partials of ``steel_matmul_axpby`` (either GPU class, with or without neural accelerators)
or ``dot_product``'s sums. The contiguous copies of its inputs, which depend on layouts the plan
does not record, are the compiler's to add.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.gpu_matmul import MATMULS, gpu_matmul_scratch
from dctms.schema.phase_index import PlanIndex

Finding = tuple[str, str]


def gpu_matmul(ix: PlanIndex) -> Iterator[Finding]:
    model = ix.plan.target.memory_model
    if model is None:
        return
    for px in ix.phases:
        phase = px.phase
        known = px.shapes_and_dtypes()
        for k, op in enumerate(phase.ops):
            if op.primitive not in MATMULS or len(op.outputs) != 1:
                continue
            if op.primitive == "QuantizedMatmul" and len(op.args) < 4:
                continue  # op_arguments' finding
            if any(t not in known for t in (*op.inputs, op.outputs[0])):
                continue  # bindings: another rule's finding
            shapes = [known[t][0] for t in op.inputs]
            dtypes = [known[t][1] for t in op.inputs]
            out = known[op.outputs[0]][0]
            need = gpu_matmul_scratch(model, op.primitive, shapes, dtypes, out, op.args)
            if op.scratch < need:
                what = "split-K partial sums" if model.name == "metal" else "transposed scales"
                yield (
                    f"{px.op_path(k)}.scratch",
                    f"{op.scratch}, but {model.name}'s {op.primitive} of these shapes may hold "
                    f"{need} bytes ({what})",
                )
