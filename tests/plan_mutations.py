"""Semantic mutations of a valid plan (issue 35's re-stamped plan edits), for the mutation fuzzer.

A mutation edits one value of a plan's JSON document where the meaning lives -- an integer
constant, an integer op argument, an affine slope or offset, a tensor's or a binding's shape, a
length point, or the index an addressing op reads (replaced by a new constant) -- to an extreme or
off-by-one value. ``apply`` edits the document in place and returns the undo, so that thousands of
cases cost no copy of the plan; a case is judged on the document as edited (re-stamped when it is
written to a file, as someone who knows the format would).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

EXTREMES = [2**31 - 1, -(2**31), 2**32 - 1, -1, 0, 1, 2**15, 2**20]
ADDRESSING = ("DynamicSlice", "DynamicSliceUpdate", "Gather", "GatherAxis", "ScatterAxis")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@dataclass
class Mutation:
    what: str  # one line: where and what was changed
    undo: Callable[[], None]


def _set(container, key, value) -> Callable[[], None]:
    old = container[key]
    container[key] = value

    def undo() -> None:
        container[key] = old

    return undo


def _near(rng: random.Random, value: int) -> int:
    """An extreme, or a value next to ``value`` (off by one, doubled, negated)."""
    return rng.choice([*EXTREMES, value + 1, value - 1, 2 * value, -value, value + 16])


def _phases(doc: dict) -> list[tuple[str, dict]]:
    phases = [(f"phases[{i}]", p) for i, p in enumerate(doc["phases"])]
    draft = doc.get("draft")
    if draft:
        phases += [(f"draft.phases[{i}]", p) for i, p in enumerate(draft["phases"])]
    return phases


def _int_leaves(value, path=()) -> list[tuple[tuple, list]]:
    """(path, the list holding it) of every integer in a nested list of op arguments."""
    out = []
    if isinstance(value, list):
        for i, v in enumerate(value):
            if type(v) is int:
                out.append(((*path, i), value))
            elif isinstance(v, list):
                out += _int_leaves(v, (*path, i))
    return out


def constant_value(doc: dict, rng: random.Random) -> Mutation | None:
    where, phase = rng.choice(_phases(doc))
    ints = [c for c in phase["constants"] if c["dtype"] in INT_DTYPES and c["value"]]
    if not ints:
        return None
    c = rng.choice(ints)
    i = rng.randrange(len(c["value"]))
    value = _near(rng, c["value"][i]) if type(c["value"][i]) is int else rng.choice(EXTREMES)
    return Mutation(f"{where} constant {c['id']}[{i}] = {value}", _set(c["value"], i, value))


def op_argument(doc: dict, rng: random.Random) -> Mutation | None:
    where, phase = rng.choice(_phases(doc))
    ops = [(k, op) for k, op in enumerate(phase["ops"]) if _int_leaves(op.get("args", []))]
    if not ops:
        return None
    if rng.random() < 0.5:  # addressing ops first: their sizes and axes are what index safety is
        addressing = [(k, op) for k, op in ops if op["primitive"] in ADDRESSING]
        ops = addressing or ops
    k, op = rng.choice(ops)
    path, holder = rng.choice(_int_leaves(op["args"]))
    value = _near(rng, holder[path[-1]])
    what = f"{where} op {k} {op['primitive']} args{list(path)} = {value}"
    return Mutation(what, _set(holder, path[-1], value))


def affine(doc: dict, rng: random.Random) -> Mutation | None:
    with_lengths = [(w, p) for w, p in _phases(doc) if p.get("lengths", {}).get("affine")]
    if not with_lengths:
        return None
    where, phase = rng.choice(with_lengths)
    fs = phase["lengths"]["affine"]
    k = rng.randrange(len(fs))
    f = fs[k]
    if rng.random() < 0.6:
        d = rng.randrange(len(f["k"]))
        value = rng.choice([-1, 0, 2, -2, 3])
        return Mutation(f"{where} affine[{k}].k[{d}] = {value}", _set(f["k"], d, value))
    value = f["c"] + rng.choice([-1, 1, -16, 16, 2**20])
    return Mutation(f"{where} affine[{k}].c = {value}", _set(f, "c", value))


def place(doc: dict, rng: random.Random) -> Mutation | None:
    """One affine place moved to another function (a size that follows the wrong length)."""
    with_lengths = [
        (w, p) for w, p in _phases(doc) if len(p.get("lengths", {}).get("affine", [])) > 1
    ]
    if not with_lengths:
        return None
    where, phase = rng.choice(with_lengths)
    fs = phase["lengths"]["affine"]
    a, b = rng.sample(range(len(fs)), 2)
    if not fs[a]["at"]:
        return None
    j = rng.randrange(len(fs[a]["at"]))
    moved = fs[a]["at"][j]
    undo_a = _set(fs[a], "at", fs[a]["at"][:j] + fs[a]["at"][j + 1 :])
    undo_b = _set(fs[b], "at", [*fs[b]["at"], moved])

    def undo() -> None:
        undo_b()
        undo_a()

    return Mutation(f"{where} place {moved} moved from affine[{a}] to affine[{b}]", undo)


def shape(doc: dict, rng: random.Random) -> Mutation | None:
    where, phase = rng.choice(_phases(doc))
    records = [("tensors", t) for t in phase["tensors"] if t["shape"]]
    records += [("inputs", b) for b in phase["inputs"] if b["shape"]]
    if not records:
        return None
    kind, r = rng.choice(records)
    axis = rng.randrange(len(r["shape"]))
    value = max(
        0, rng.choice([r["shape"][axis] + 1, r["shape"][axis] - 1, 2 * r["shape"][axis], 0])
    )
    what = f"{where} {kind} {r['id']} shape[{axis}] = {value}"
    return Mutation(what, _set(r["shape"], axis, value))


def point(doc: dict, rng: random.Random) -> Mutation | None:
    with_lengths = [(w, p) for w, p in _phases(doc) if p.get("lengths")]
    if not with_lengths:
        return None
    where, phase = rng.choice(with_lengths)
    points = phase["lengths"]["points"]
    k = rng.randrange(len(points))
    d = rng.randrange(len(points[k]))
    value = max(1, points[k][d] + rng.choice([-1, 1, -3, 5]))
    new = [*points[k][:d], value, *points[k][d + 1 :]]
    return Mutation(f"{where} lengths.points[{k}] = {new}", _set(points, k, new))


def index_input(doc: dict, rng: random.Random) -> Mutation | None:
    """An addressing op's index read from a new constant of an extreme value (the issue's
    ``DynamicSlice`` start of 2^31 - 1 and token ``Gather`` index of 2^32 - 1)."""
    where, phase = rng.choice(_phases(doc))
    ops = [(k, op) for k, op in enumerate(phase["ops"]) if op["primitive"] in ADDRESSING]
    if not ops:
        return None
    k, op = rng.choice(ops)
    slot = len(op["inputs"]) - 1 if op["primitive"].startswith("Dynamic") else 1
    if slot < 1 or slot >= len(op["inputs"]):
        return None
    value = rng.choice([2**31 - 1, -(2**31), 2**32 - 1, -1, 2**16])
    dtype = "uint32" if value == 2**32 - 1 else "int32"
    shape = [1] if op["primitive"].startswith("Dynamic") else [1, 1]
    constant = {"id": "fuzz.index", "shape": shape, "dtype": dtype, "value": [value] * shape[-1]}
    undo_c = _set(phase, "constants", [*phase["constants"], constant])
    inputs = list(op["inputs"])
    inputs[slot] = "fuzz.index"
    undo_i = _set(op, "inputs", inputs)

    def undo() -> None:
        undo_i()
        undo_c()

    return Mutation(f"{where} op {k} {op['primitive']} index = constant {value}", undo)


MUTATORS = (constant_value, op_argument, affine, place, shape, point, index_input)


def mutate(doc: dict, rng: random.Random) -> Mutation:
    """One mutation of ``doc`` (in place); retried until a mutator finds something to change."""
    while True:
        found = rng.choice(MUTATORS)(doc, rng)
        if found is not None:
            return found


def rejected(plan) -> bool:
    """``verify_plan(plan) != []``, sooner: the rules one at a time, the costliest last, stopping
    at the first problem (the same verdict: a plan is refused when any rule finds one)."""
    from dctms.schema.draft import draft_view
    from dctms.schema.phase_index import build_plan_index
    from dctms.schema.verify import RULES

    ix = build_plan_index(plan)
    # The rules that refuse most mutants first (measured on these plans), the costliest last.
    first = ("lengths", "tensor_bytes", "state_capacity", "constant_values", "op_arguments")
    last = ("run_ahead", "index_safety")
    order = [*first, *(n for n in RULES if n not in first + last), *last]
    if any(next(iter(RULES[name](ix)), None) is not None for name in order):
        return True
    return plan.draft is not None and rejected(draft_view(plan))
