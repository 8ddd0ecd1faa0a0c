"""Verifier rule for a sampling plan: its prefill and decode phases take exactly the inputs the
runner feeds (``schema.sampling``) and return the outputs it reads, in the shapes it builds them.

The runner bounds every id it feeds (recent tokens, logit-bias ids) by ``model.vocab_size``, so
the sizes that matter are read from the bindings here: one repetition window ``R`` shared by the
input and the decode output, one slot count ``B`` for bias ids and values, one ``K`` for the top
log-probabilities, at most the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PlanIndex
from dctms.schema.sampling import INPUTS, SAMPLED_PHASES, outputs_for, samples

Finding = tuple[str, str]


def sampling(ix: PlanIndex) -> Iterator[Finding]:
    """A --sampling plan's prefill and decode have every sampling input and output, in the shapes
    and dtypes the runner feeds and reads; no other phase takes one."""
    plan = ix.plan
    sizes: dict[str, int] = {}  # R, B, K: the same in every phase
    for px in ix.phases:
        if px.phase.name not in SAMPLED_PHASES:
            if samples(plan) and any(b.name in INPUTS for b in px.phase.inputs):
                yield f"{px.path}.inputs", f"{px.phase.name} takes sampling inputs the runner never feeds"
            continue
        if not samples(plan):
            continue
        given = {b.name: b for b in px.phase.inputs if b.kind == "input"}
        for name, want in INPUTS.items():
            yield from _binding(f"{px.path}.inputs", name, given.get(name), want, sizes)
        results = {b.name: b for b in px.phase.outputs if b.kind == "output"}
        for name, want in outputs_for(px.phase.name).items():
            yield from _binding(f"{px.path}.outputs", name, results.get(name), want, sizes)
        yield from _bounded_indices(px, plan.model.vocab_size)
        for letter, size in sizes.items():
            if size < 1:
                yield px.path, f"sampling size {letter} is {size}, must be at least 1"
        if sizes.get("K", 0) > plan.model.vocab_size:
            yield px.path, f"{sizes['K']} top log-probabilities, more than the vocabulary"


def _binding(where: str, name: str, b, want: tuple, sizes: dict[str, int]) -> Iterator[Finding]:
    shape, dtype = want
    if b is None:
        yield where, f"no binding named {name!r} (a --sampling plan's phases have it)"
        return
    if len(b.shape) != len(shape):
        yield where, f"{name!r} has shape {list(b.shape)}, expected {len(shape)} axes"
        return
    for got, expected in zip(b.shape, shape, strict=True):
        if isinstance(expected, str):
            if sizes.setdefault(expected, got) != got:
                yield where, f"{name!r} has {got} along {expected}, elsewhere {sizes[expected]}"
        elif got != expected:
            yield where, f"{name!r} has shape {list(b.shape)}, expected {list(shape)}"
    if dtype is not None and b.dtype != dtype:
        yield where, f"{name!r} is {b.dtype}, expected {dtype}"


# Ops that pass their index values through unchanged (a concatenation or selection of index
# values, a slice or reshape of them, a cast of non-negative ids).
_KEEPS_VALUES = frozenset(
    {"Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Slice", "Broadcast", "AsType"}
)
# The per-call inputs whose values the runner bounds by model.vocab_size.
_IDS = ("tokens", "recent", "bias_ids")


def _id_values(phase) -> set[str]:
    """Tensor ids holding only token ids the runner fed (below the vocabulary size)."""
    ids = {b.id for b in phase.inputs if b.kind == "input" and b.name in _IDS}
    changed = True
    while changed:  # ops are not necessarily in dataflow order in a broken plan
        changed = False
        for op in phase.ops:
            if op.primitive in _KEEPS_VALUES and len(op.inputs) == 1:
                carried = op.inputs[0] in ids
            elif op.primitive == "Concatenate":
                carried = bool(op.inputs) and all(i in ids for i in op.inputs)
            elif op.primitive == "Select" and len(op.inputs) == 3:
                carried = op.inputs[1] in ids and op.inputs[2] in ids
            else:
                continue
            for out in op.outputs if carried else ():
                if out not in ids:
                    ids.add(out)
                    changed = True
    return ids


def _bounded_indices(px, vocab: int) -> Iterator[Finding]:
    """A gather or scatter along an axis indexed by fed token ids holds the whole vocabulary
    (MLX does not bounds-check them)."""
    phase = px.phase
    ids = _id_values(phase)
    shapes = {t.id: t.shape for t in phase.tensors}
    shapes.update((b.id, b.shape) for b in phase.inputs)
    for k, op in enumerate(phase.ops):
        if op.primitive not in ("GatherAxis", "ScatterAxis") or len(op.inputs) < 2:
            continue
        if op.inputs[1] not in ids:
            continue
        axis = op.args[0] if op.primitive == "GatherAxis" else op.args[-1]
        shape = shapes.get(op.inputs[0], [])
        size = shape[axis] if isinstance(axis, int) and -len(shape) <= axis < len(shape) else 0
        if size < vocab:
            yield (
                px.op_path(k),
                f"{op.primitive} indexes {size} entries along axis {axis} with token ids, fewer "
                f"than model.vocab_size {vocab}",
            )
