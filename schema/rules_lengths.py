"""Verifier rule about real-length phases (``Phase.lengths``): the record is consistent with the
phase planned at the bound.

What it re-derives from the plan alone: every point lies within the bound (a point above it would
run tensors larger than planned); the bound is the phase's own (``tokens`` = ``Phase.tokens``, the
window a proper slice of the cache: <= ``kv_capacity`` - 1); every affine place exists and holds,
at the bound, exactly the value its function gives there; a varying input or output-shape axis
never shrinks as a length grows. (That each point keeps the bound's lifetimes is the compiler's
check, made with its memory model: ``dctms.toolkit.lengths``.)
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.phase_index import PhaseIndex, PlanIndex

Finding = tuple[str, str]


def lengths(ix: PlanIndex) -> Iterator[Finding]:
    """Phase.lengths points within the bound, the bound the phase's own, affine places that hold."""
    capacity = ix.plan.bounds.kv_capacity
    for px in ix.phases:
        rec = px.phase.lengths
        if rec is None:
            continue
        where = f"{px.path}.lengths"
        names = list(rec.names)
        if len(set(names)) != len(names) or len(rec.bound) != len(names):
            yield where, f"names {names} must be distinct, one bound each (got {rec.bound})"
            continue
        bound = dict(zip(names, rec.bound, strict=True))
        if "tokens" in bound and bound["tokens"] != px.phase.tokens:
            yield (
                f"{where}.bound",
                (f"tokens bound {bound['tokens']} is not the phase's {px.phase.tokens} tokens"),
            )
        if "window" in bound and bound["window"] > capacity - 1:
            yield (
                f"{where}.bound",
                (
                    f"window bound {bound['window']} is not a proper slice of the "
                    f"{capacity}-position cache"
                ),
            )
        if list(rec.bound) not in [list(p) for p in rec.points]:
            yield f"{where}.points", "the bound itself is not among the points"
        for k, point in enumerate(rec.points):
            if len(point) != len(names) or any(
                x > b for x, b in zip(point, rec.bound, strict=False)
            ):
                yield f"{where}.points[{k}]", f"{point} is not within the bound {rec.bound}"
        for k, f in enumerate(rec.affine):
            if len(f.k) != len(names):
                yield f"{where}.affine[{k}]", f"{len(f.k)} coefficients for {len(names)} lengths"
                continue
            at_bound = sum(a * b for a, b in zip(f.k, rec.bound, strict=True)) + f.c
            for place in f.at:
                problem = _check_place(px, place, at_bound, list(f.k))
                if problem:
                    yield f"{where}.affine[{k}]", f"{place}: {problem}"


def _check_place(px: PhaseIndex, place: str, at_bound: int, k: list[int]) -> str:
    where, sep, path = place.partition("/")
    if not sep or not where[1:]:
        return "not of the form o<op>/<path>, i<input>/<axis> or t<tensor>/<axis>"
    kind, name = where[0], where[1:]
    if kind == "o":
        if not name.isdigit() or int(name) not in px.op_at_index:
            return "no such op"
        value = px.phase.ops[px.op_at_index[int(name)]].args
        try:
            for step in path.split(".") if path else []:
                value = value[int(step)]
        except (IndexError, TypeError, ValueError):
            return "no such argument"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"the argument is {value!r}, not a number"
        return (
            "" if value == at_bound else f"is {value} at the bound, the function gives {at_bound}"
        )
    if kind in "it":
        if kind == "i":
            shape = px.inputs[name].shape if name in px.inputs else None
        else:
            pos = px.tensor_at.get(name)
            shape = px.phase.tensors[pos].shape if pos is not None else None
        if shape is None:
            return "no such input" if kind == "i" else "no such tensor"
        if not path.isdigit() or int(path) >= len(shape):
            return f"no axis {path} in shape {shape}"
        if any(a < 0 for a in k):
            return "a size that shrinks as a length grows"
        axis = int(path)
        size = shape[axis]
        return "" if size == at_bound else f"is {size} at the bound, the function gives {at_bound}"
    return "not of the form o<op>/<path>, i<input>/<axis> or t<tensor>/<axis>"
