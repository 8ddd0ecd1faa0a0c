"""Pass 1d, fused projections: one matmul where a layer multiplies one input by several weights.

A decoder layer projects the same normalised hidden states three times (queries, keys, values) and
its feed-forward block twice (gate, up): separate ``x @ W.T`` matmuls, each a BLAS call that streams
its own weight. Stacking the weights along their output axis gives one matmul whose output columns
are the separate results side by side, so the graph becomes

    Transpose(W_fused) -> Matmul(x, .) -> Y;  y_i = Slice(Y, columns of part i)

with every ``y_i`` keeping its tensor id (its readers are unchanged). On SmolLM2-135M a decode step
then makes 60 BLAS calls fewer; mlx-lm's own layers cannot do this without a second copy of the
weights, the runner can for free: it lays the parts out end to end in its weight arena and reads the
fused weight as one view of them (``runner.weight_arena``; ``Weights.fused`` in the plan).

Fused where it is exactly that: ``Matmul`` ops (not ``AddMM``: a bias is left as it is) whose
second input is the transpose of a 2-D weight read nowhere else, grouped by their first input (the
same tensor: the common-subexpression pass has merged each matmul's flattening of it), the weight's
dtype and width; two or more per group. The memory passes then plan ``Y`` and its slices (a slice is
a view; a reshape of a strided one copies, as MLX does). With a length fit, ``Y``'s rows and the
slices' row bound follow the fitted rows of the outputs they replace.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from dctms.toolkit.lengths import LengthFit, reindexed
from dctms.toolkit.trace import TracedBinding, TracedOp, TracedPhase, TracedTensor


@dataclass(frozen=True)
class _Member:
    matmul: int  # op index of x @ W.T
    transpose: int  # op index of W.T
    weight: TracedBinding
    output: str  # the matmul's output id


def _shared_head(split: list[list[str]], keep: int = 0) -> int:
    """How many leading names all of ``split`` share, leaving at least ``keep`` names after."""
    n = 0
    while all(len(s) > n + keep for s in split) and len({s[n] for s in split}) == 1:
        n += 1
    return n


def fused_name(parts: list[str]) -> str:
    """``a.b.{q_proj,k_proj}.weight`` for ``a.b.q_proj.weight`` and ``a.b.k_proj.weight``."""
    split = [p.split(".") for p in parts]
    head = _shared_head(split, keep=1)
    tail = 0
    while all(len(s) > head + tail + 1 for s in split) and len({s[-1 - tail] for s in split}) == 1:
        tail += 1
    middles = [".".join(s[head : len(s) - tail]) for s in split]
    return ".".join(
        [*split[0][:head], "{" + ",".join(middles) + "}", *split[0][len(split[0]) - tail :]]
    )


def conflicting_weights(phases: list[TracedPhase]) -> frozenset[str]:
    """Weights that phases would fuse into different groups (a model whose attention and MLP read
    one input, as cohere's: decode fuses all five projections, but prefill's last layer feeds its
    MLP the picked row only): every weight of such groups, left unfused everywhere, because the
    runner holds one arena per fused weight."""
    seen: dict[str, tuple[str, ...]] = {}
    bad: set[str] = set()
    for phase in phases:
        for members in _groups(phase):
            parts = tuple(m.weight.name for m in members)
            for w in parts:
                other = seen.setdefault(w, parts)
                if other != parts:
                    bad.update(parts)
                    bad.update(other)
    return frozenset(bad)


def fuse_projections(
    phase: TracedPhase, lf: LengthFit | None = None, exclude: frozenset[str] = frozenset()
) -> tuple[TracedPhase, LengthFit | None, dict[str, tuple[str, ...]]]:
    """The phase with each group of projections of one input fused (but groups holding a weight of
    ``exclude``); its length fit re-indexed and extended to the new ops; the fused weights
    (name -> part names, in column order)."""
    groups = [g for g in _groups(phase) if not any(m.weight.name in exclude for m in g)]
    if not groups:
        return phase, lf, {}
    replaced: dict[int, list[tuple[TracedOp, str | None, dict]]] = {}  # index -> new ops
    dropped: set[int] = set()
    tensors = dict(phase.tensors)
    inputs = list(phase.inputs)
    row_fits: dict[str, dict] = {}  # the fused outputs' rows, as the length fit changes them
    fused: dict[str, tuple[str, ...]] = {}
    gone_weights: set[str] = set()
    paths = phase.module_paths
    for n, members in enumerate(groups):
        parts = tuple(m.weight.name for m in members)
        name = fused_name(list(parts))
        fused[name] = parts
        first = members[0]
        k = first.weight.shape[1]
        total = sum(m.weight.shape[0] for m in members)
        dtype = first.weight.dtype
        rows = tensors[first.output].shape[0]
        wid, tid, yid = f"fused{n}.w", f"fused{n}.wt", f"fused{n}.y"
        inputs.append(TracedBinding(wid, "weight", name, (total, k), dtype))
        tensors[wid] = TracedTensor(wid, (total, k), dtype)
        tensors[tid] = TracedTensor(tid, (k, total), dtype)
        tensors[yid] = TracedTensor(yid, (rows, total), tensors[first.output].dtype)
        row_fit = lf.shapes.get(first.output, {}).get(0) if lf is not None else None
        if row_fit is not None:
            row_fits[yid] = {0: row_fit}
        path = _common_path([paths[m.matmul] for m in members]) if paths is not None else None
        new = [
            (TracedOp("Transpose", [[1, 0]], (wid,), (tid,)), path, {}),
            (TracedOp("Matmul", [], (phase.ops[first.matmul].inputs[0], tid), (yid,)), path, {}),
        ]
        offset = 0
        for m in members:
            width = m.weight.shape[0]
            args = [[0, offset], [rows, offset + width], [1, 1]]
            fits = {(1, 0): row_fit} if row_fit is not None else {}
            new.append(
                (
                    TracedOp("Slice", args, (yid,), (m.output,)),
                    paths[m.matmul] if paths else None,
                    fits,
                )
            )
            offset += width
            dropped.update((m.matmul, m.transpose))
            gone_weights.add(m.weight.id)
        replaced[min(m.matmul for m in members)] = new
    ops, new_paths, new_index, added_fits = [], [], {}, {}
    for i, op in enumerate(phase.ops):
        for new_op, path, fits in replaced.get(i, ()):
            added_fits.update({(len(ops), p): f for p, f in fits.items()})
            ops.append(new_op)
            new_paths.append(path)
        if i in dropped:
            continue
        new_index[i] = len(ops)
        ops.append(op)
        new_paths.append(paths[i] if paths is not None else None)
    gone = gone_weights | {phase.ops[m.matmul].inputs[1] for g in groups for m in g}
    for t in gone:
        tensors.pop(t, None)
    merged = replace(
        phase,
        ops=ops,
        inputs=[b for b in inputs if b.id not in gone_weights],
        tensors=tensors,
        module_paths=new_paths if paths is not None else None,
    )
    if lf is not None:
        lf = reindexed(lf, new_index, gone)
        lf = replace(lf, args={**lf.args, **added_fits}, shapes={**lf.shapes, **row_fits})
    return merged, lf, fused


def _groups(phase: TracedPhase) -> list[list[_Member]]:
    weights = {b.id: b for b in phase.inputs if b.kind == "weight"}
    bound = {b.id for b in phase.outputs}
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = defaultdict(list)
    for i, op in enumerate(phase.ops):
        for t in op.outputs:
            producer[t] = i
        for t in op.inputs:
            readers[t].append(i)
    by_key: dict[tuple, list[_Member]] = defaultdict(list)
    for i, op in enumerate(phase.ops):
        if op.primitive != "Matmul" or len(op.inputs) != 2 or len(op.outputs) != 1:
            continue
        x, wt = op.inputs
        j = producer.get(wt)
        if j is None:
            continue
        t = phase.ops[j]
        w = weights.get(t.inputs[0]) if len(t.inputs) == 1 else None
        if t.primitive != "Transpose" or t.args != [[1, 0]] or w is None or len(w.shape) != 2:
            continue
        if readers[wt] != [i] or readers[w.id] != [j] or op.outputs[0] in bound:
            continue
        if len(phase.tensors[x].shape) != 2:
            continue
        by_key[(x, w.dtype, w.shape[1])].append(_Member(i, j, w, op.outputs[0]))
    return [members for members in by_key.values() if len(members) > 1]


def _common_path(paths: list[str | None]) -> str | None:
    if not paths or any(p is None for p in paths):
        return paths[0] if paths else None
    split = [p.split(".") for p in paths]
    return ".".join(split[0][: _shared_head(split)]) or paths[0]
