"""Pass 1c, common subexpressions: one op where the traced graph computes the same value twice.

mlx-lm's layers each recompute what depends only on the position and the model's constants: on
the CPU, ``mx.fast.rope`` and ``scaled_dot_product_attention`` are decompositions, so every layer's
queries and keys get their own ``Arange``, inverse frequencies (``Exp``, ``Multiply``), angles,
``Sin`` and ``Cos``, and their own broadcasts -- on SmolLM2's 30 layers 825 of a decode step's 3,581
primitives (23 %), the same in prefill. MLX's lazy evaluation runs each of them: every one is a
task on the CPU stream. The plan is static, so the compiler can prove two ops equal once, for every
call, and keep one.

Two ops are the same value when they have the same primitive, the same arguments and the same
inputs (after earlier merges): MLX primitives are pure functions of those. With a length fit
(``toolkit.lengths``) the arguments must also change with the lengths in the same way -- the same
affine function at every path -- so the merge holds at every point the runner may use, not only at
the bound. The later op is dropped and its readers read the earlier op's outputs; the memory passes
then run on the merged graph, so the envelope covers the longer life of a shared tensor.

Never merged: random number generation, mlx.distributed's collectives (each is a message a peer
waits for) and an op whose output is a phase output (a binding names it).
"""

from __future__ import annotations

from dataclasses import replace

from dctms.toolkit.lengths import LengthFit, _leaves, reindexed
from dctms.toolkit.trace import TracedOp, TracedPhase

# Primitives that are not pure functions of their inputs and arguments, or that talk to peers.
NEVER_MERGED = frozenset({"RandomBits", "AllReduce", "AllGather", "Send", "Recv"})


def _frozen(value) -> object:
    """A hashable, exact form of an argument tree (1 and 1.0, 0.0 and -0.0 stay apart)."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, value)


def merge_common_ops(
    phase: TracedPhase, lf: LengthFit | None = None
) -> tuple[TracedPhase, LengthFit | None]:
    """The phase with every op that repeats an earlier op's value removed (its readers read the
    earlier op's outputs), and its length fit re-indexed to the remaining ops."""
    bound_outputs = {b.id for b in phase.outputs}
    renamed: dict[str, str] = {}
    first: dict[tuple, TracedOp] = {}
    kept: list[int] = []
    ops: list[TracedOp] = []
    for i, op in enumerate(phase.ops):
        inputs = tuple(renamed.get(t, t) for t in op.inputs)
        if inputs != op.inputs:
            op = replace(op, inputs=inputs)
        key = _key(i, op, phase, lf) if _mergeable(op, bound_outputs) else None
        earlier = first.get(key) if key is not None else None
        if earlier is not None:
            renamed.update(zip(op.outputs, earlier.outputs, strict=True))
            continue
        if key is not None:
            first[key] = op
        kept.append(i)
        ops.append(op)
    if not renamed:
        return phase, lf
    paths = phase.module_paths
    merged = replace(
        phase,
        ops=ops,
        tensors={t: x for t, x in phase.tensors.items() if t not in renamed},
        module_paths=[paths[i] for i in kept] if paths is not None else None,
    )
    if lf is not None:
        lf = reindexed(lf, {old: new for new, old in enumerate(kept)}, renamed)
    return merged, lf


def _mergeable(op: TracedOp, bound_outputs: set[str]) -> bool:
    return (
        op.primitive not in NEVER_MERGED
        and bool(op.outputs)
        and not bound_outputs.intersection(op.outputs)
    )


def _key(i: int, op: TracedOp, phase: TracedPhase, lf: LengthFit | None) -> tuple:
    """What makes two ops the same value: primitive, arguments, inputs, and the outputs' shapes
    and dtypes (a creation op's dtype is not among its arguments: ``Arange`` makes int32 mask
    positions and float32 rotary positions from the same numbers), each as the length fit
    changes it."""
    fitted, shapes = (), ()
    if lf is not None:
        fitted = tuple(
            (path, lf.args[(i, path)], (i, path) in lf.floats)
            for path, _ in _leaves(op.args)
            if (i, path) in lf.args
        )
        shapes = tuple(tuple(sorted(lf.shapes.get(t, {}).items())) for t in op.outputs)
    outputs = tuple((phase.tensors[t].shape, phase.tensors[t].dtype) for t in op.outputs)
    return (op.primitive, _frozen(op.args), op.inputs, outputs, fitted, shapes)
