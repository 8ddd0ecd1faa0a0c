"""Fused weights (``Weights.fused``): what shape and dtype each one has, and what makes one wrong.

A fused weight is its parts end to end along axis 0: every part has the same dtype and the same
trailing dimensions, and the fused shape is the parts' first dimensions summed. Used by the
verifier (a binding of a fused weight must match it) and by the runner (which builds the view)."""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.types import FusedWeight, Weights, WeightTensor


def fused_shape(parts: list[WeightTensor]) -> tuple[list[int], str]:
    """The shape and dtype of ``parts`` end to end along axis 0 (they must be able to be)."""
    first = parts[0]
    return [sum(p.shape[0] for p in parts), *first.shape[1:]], first.dtype


def fused_tensors(weights: Weights) -> dict[str, WeightTensor]:
    """Each well-formed fused weight as a tensor of its own (its bytes are its parts')."""
    tensors = {w.name: w for w in weights.tensors}
    out = {}
    for fw in weights.fused:
        if _problem(fw, tensors, set()) is None:
            parts = [tensors[p] for p in fw.parts]
            shape, dtype = fused_shape(parts)
            out[fw.name] = WeightTensor(fw.name, shape, dtype, sum(p.bytes for p in parts))
    return out


def fused_problems(weights: Weights) -> Iterator[tuple[str, str]]:
    """(JSON path, message) for every fused weight that is not its parts end to end."""
    tensors = {w.name: w for w in weights.tensors}
    taken: set[str] = set()
    names: set[str] = set()
    for k, fw in enumerate(weights.fused):
        where = f"$.model.weights.fused[{k}]"
        if fw.name in tensors or fw.name in names:
            yield f"{where}.name", f"{fw.name!r} is already the name of a weight"
        names.add(fw.name)
        problem = _problem(fw, tensors, taken)
        if problem is not None:
            yield f"{where}.parts", problem
        taken.update(fw.parts)


def _problem(fw: FusedWeight, tensors: dict[str, WeightTensor], taken: set[str]) -> str | None:
    if len(fw.parts) < 2:
        return f"fuses {len(fw.parts)} tensor(s); a fused weight has two or more"
    if len(set(fw.parts)) != len(fw.parts):
        return "names a part twice"
    for p in fw.parts:
        if p not in tensors:
            return f"no weight named {p!r} in the plan"
        if p in taken:
            return f"{p!r} is a part of another fused weight too"
    parts = [tensors[p] for p in fw.parts]
    first = parts[0]
    if any(p.stored_dtype is not None for p in parts):
        return "a part cast at load (stored_dtype) is not fused: the runner reads parts as stored"
    for p in parts[1:]:
        if p.dtype != first.dtype:
            return f"{p.name} is {p.dtype}, {first.name} {first.dtype}: parts share one dtype"
        if not p.shape or not first.shape or p.shape[1:] != first.shape[1:]:
            return (
                f"{p.name} {p.shape} and {first.name} {first.shape} cannot be laid end to end "
                "along axis 0"
            )
        if p.shard is not None or first.shard is not None:
            return "a tensor-parallel rank's slices are not fused"
    return None
