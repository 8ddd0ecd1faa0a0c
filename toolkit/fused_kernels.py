"""Pass 1b', fused kernels: MLX's composite of an ``mx.fast`` call becomes that call's one plan op.

The graph is traced on the CPU, where ``mx.fast.rms_norm``, ``mx.fast.rope`` and
``mx.fast.scaled_dot_product_attention`` fall back to MLX's composites (square, mean, rsqrt,
multiply; sines, cosines and the rotated halves; scores, scale, mask, softmax, values, with the
grouped-query broadcast). A GPU runs each as one kernel, so a plan for a GPU target holds the
kernel (``schema.fast_ops``: ``RMSNorm``, ``RoPE``, ``ScaledDotProductAttention``, with MLX's own
arguments); ``compile --fused`` does the same for a CPU plan, whose runner then calls ``mx.fast.*``
(its fallback is that very composite).

Found by structure, substituted only where proven: a candidate's arguments are read off the graph
(``toolkit.fused_candidates``: eps; the rotary base, scale and dims; the attention scale and
mask), then the call is traced
anew on placeholders of the candidate's input shapes and dtypes -- MLX's own composite for those
arguments -- and matched op for op against the candidate from its output back to its inputs:
the same primitives, arguments, output shapes and dtypes, inputs in the same order, constants of
the same value, every op of the reference matched to a distinct op. Anything else is left as it
is. An intermediate something outside the composite reads stays in the graph, computed as before.
Nor is a composite substituted whose intermediates hold more bytes than ``schema.fast_ops`` would
charge the op (the CPU fallback's count), so a plan never charges a fused op less than it holds.
The pass runs before the common-subexpression pass, which then merges what the calls left shared.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx

from dctms.schema import fast_ops
from dctms.schema.fast_ops import FUSED, RMS_NORM, ROPE
from dctms.schema.sizes import nbytes
from dctms.toolkit.common_ops import _frozen
from dctms.toolkit.fused_candidates import Candidate, Graph, candidates
from dctms.toolkit.lengths import LengthFit, reindexed
from dctms.toolkit.memory_model import VIEW_ALWAYS
from dctms.toolkit.trace import DTYPES, TracedOp, TracedPhase, _export

_DTYPE = {**DTYPES, "int32": mx.int32, "bool": mx.bool_}


@dataclass(frozen=True)
class Fused:
    """One substitution: the fused op and the composite ops it stands for (in traced order)."""

    op: TracedOp
    composite: tuple[TracedOp, ...]
    internal_bytes: int  # bytes of the composite's intermediates that are not views


def fuse_kernels(
    phase: TracedPhase, lf: LengthFit | None = None
) -> tuple[TracedPhase, LengthFit | None, list[Fused]]:
    """The phase with every proven composite of an ``mx.fast`` call replaced by its fused op (at
    the composite's output position, keeping the output's id); the length fit re-indexed; the
    substitutions made.

    MLX's exporter shares equal ops between calls (the broadcast of a scalar constant, a layer's
    rotary angles for its queries and keys, the grouped-query view of a shared mask): a
    composite's op is kept while anything left in the graph reads it (it computes what it did);
    every other op of a composite goes."""
    g = Graph(phase)
    bound = {b.id for b in phase.outputs}
    found: dict[int, Fused] = {}  # output op index -> substitution
    composite_ops: set[int] = set()
    for cand in candidates(g):
        at = g.producer[cand.output]
        if at in found or at in composite_ops:
            continue
        matched = _verified(g, cand)
        if matched is not None:
            found[at] = matched[0]
            composite_ops |= matched[1]
    if not found:
        return phase, lf, []
    keep = _reachable(g, found, composite_ops, bound)
    ops, paths, new_index, gone = [], [], {}, set()
    old_paths = phase.module_paths
    for i, op in enumerate(phase.ops):
        if i in found:
            ops.append(found[i].op)
        elif i in composite_ops and i not in keep:
            gone.update(op.outputs)
            continue
        else:
            new_index[i] = len(ops)
            ops.append(op)
        paths.append(old_paths[i] if old_paths is not None else None)
    fused_phase = replace(
        phase,
        ops=ops,
        tensors={t: x for t, x in phase.tensors.items() if t not in gone},
        module_paths=paths if old_paths is not None else None,
    )
    if lf is not None:
        lf = reindexed(lf, new_index, gone)
    return fused_phase, lf, [found[i] for i in sorted(found)]


def _reachable(g: Graph, found: dict[int, Fused], composite: set[int], bound: set[str]) -> set[int]:
    """The composites' ops something outside them still reads (the graph's outputs back through
    every op left and every fused op's inputs)."""
    keep: set[int] = set()
    stack = list(bound)
    seen: set[str] = set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        i = g.producer.get(t)
        if i is None:
            continue
        if i in found:
            stack.extend(found[i].op.inputs)
            continue
        if i in composite:
            keep.add(i)
        stack.extend(g.phase.ops[i].inputs)
    return keep


# --------------------------------------------------------------------------------- verification


@lru_cache(maxsize=256)
def reference(cand_key: tuple) -> TracedPhase | None:
    """MLX's composite of one ``mx.fast`` call on placeholders (traced on the CPU)."""
    primitive, args, specs = cand_key
    feeds = {
        f"in{k}": mx.zeros(shape, dtype=_DTYPE[dtype]) for k, (shape, dtype) in enumerate(specs)
    }

    def call(*xs):
        if primitive == RMS_NORM:
            return mx.fast.rms_norm(xs[0], xs[1], args[0])
        if primitive == ROPE:
            dims, traditional, base, scale, _ = args
            freqs = xs[2] if len(xs) > 2 else None
            return mx.fast.rope(
                xs[0], dims, traditional=traditional, base=None if freqs is not None else base,
                scale=scale, offset=xs[1], freqs=freqs,
            )  # fmt: skip
        mask = xs[3] if len(xs) > 3 else ("causal" if args[1] else None)
        return mx.fast.scaled_dot_product_attention(xs[0], xs[1], xs[2], scale=args[0], mask=mask)

    try:
        with mx.stream(mx.cpu):
            return _export("reference", 0, call, feeds, {}, {}, [], ("out",))
    except Exception:  # noqa: BLE001 - MLX refuses these arguments: no candidate
        return None


def _verified(g: Graph, cand: Candidate) -> tuple[Fused, set[int]] | None:
    """The substitution when the candidate is exactly MLX's composite for its arguments."""
    tensors = g.phase.tensors
    if any(t not in tensors for t in cand.inputs) or cand.output not in g.producer:
        return None
    specs = tuple((tensors[t].shape, tensors[t].dtype) for t in cand.inputs)
    if any(d not in _DTYPE for _, d in specs):
        return None
    ref = reference((cand.primitive, cand.args, specs))
    if ref is None or len(ref.outputs) != 1:
        return None
    placeholders = {b.id: cand.inputs[k] for k, b in enumerate(ref.inputs)}
    m = _Matcher(g, ref, placeholders)
    if not m.unify(ref.outputs[0].id, cand.output) or len(m.opmap) != len(ref.ops):
        return None
    ops = set(m.opmap.values())
    size = sum(
        nbytes(tensors[t].shape, tensors[t].dtype)
        for i in ops
        if g.phase.ops[i].primitive not in VIEW_ALWAYS
        for t in g.phase.ops[i].outputs
        if t != cand.output
    )
    op = TracedOp(cand.primitive, list(cand.args), cand.inputs, (cand.output,))
    composite = tuple(g.phase.ops[i] for i in sorted(ops))
    charge = sum(fast_ops.scratch_buffers("cpu", cand.primitive, [s for s, _ in specs],
                                          [d for _, d in specs], list(cand.args)))  # fmt: skip
    if size > charge:
        return None  # the charge schema.fast_ops would make is less than this composite holds
    return Fused(op, composite, size), ops


class _Matcher:
    """Unifies the reference composite with the phase graph from the output back."""

    def __init__(self, g: Graph, ref: TracedPhase, placeholders: dict[str, str]):
        self.g, self.ref = g, ref
        self.placeholders = placeholders
        self.ref_constants = {c.id: c for c in ref.constants}
        self.ref_producer = {t: k for k, op in enumerate(ref.ops) for t in op.outputs}
        self.tmap: dict[str, str] = {}
        self.opmap: dict[int, int] = {}
        self.used: set[int] = set()

    def unify(self, rt: str, pt: str) -> bool:
        if rt in self.tmap:
            return self.tmap[rt] == pt
        g = self.g
        if rt in self.placeholders:
            ok = self.placeholders[rt] == pt
        elif rt in self.ref_constants:
            c, pc = self.ref_constants[rt], g.constants.get(pt)
            ok = (
                pc is not None
                and pc.shape == c.shape
                and pc.dtype == c.dtype
                and _frozen(pc.value) == _frozen(c.value)
            )
        else:
            ok = self._unify_op(rt, pt)
        if ok:
            self.tmap[rt] = pt
        return ok

    def _unify_op(self, rt: str, pt: str) -> bool:
        g, ref = self.g, self.ref
        rk, pk = self.ref_producer.get(rt), g.producer.get(pt)
        if rk is None or pk is None:
            return False
        ro, po = ref.ops[rk], g.phase.ops[pk]
        if rk in self.opmap:
            return self.opmap[rk] == pk and ro.outputs.index(rt) == po.outputs.index(pt)
        if pk in self.used or ro.primitive != po.primitive or _frozen(ro.args) != _frozen(po.args):
            return False
        if len(ro.inputs) != len(po.inputs) or len(ro.outputs) != len(po.outputs):
            return False
        if ro.outputs.index(rt) != po.outputs.index(pt):
            return False
        for a, b in zip(ro.outputs, po.outputs, strict=True):
            ra, pb = ref.tensors[a], g.phase.tensors[b]
            if ra.shape != pb.shape or ra.dtype != pb.dtype:
                return False
        self.opmap[rk] = pk
        self.used.add(pk)
        for a, b in zip(ro.outputs, po.outputs, strict=True):
            self.tmap[a] = b
        return all(self.unify(a, b) for a, b in zip(ro.inputs, po.inputs, strict=True))


def expanded(phase: TracedPhase) -> TracedPhase:
    """The phase as MLX's CPU runs it: every fused op replaced by MLX's composite for it, with
    ids of its own (what the runner's ``mx.fast`` call builds: its own scalars and intermediates,
    shared with nothing)."""
    ops: list[TracedOp] = []
    paths: list[str | None] = []
    tensors = dict(phase.tensors)
    constants = list(phase.constants)
    old_paths = phase.module_paths
    for k, op in enumerate(phase.ops):
        path = old_paths[k] if old_paths is not None else None
        if op.primitive not in FUSED:
            ops.append(op)
            paths.append(path)
            continue
        specs = tuple((tensors[t].shape, tensors[t].dtype) for t in op.inputs)
        ref = reference((op.primitive, tuple(op.args), specs))
        if ref is None:  # cannot happen for an op this pass made; never plan around it
            raise ValueError(f"MLX refuses {op.primitive} {op.args} of {specs}")
        name = {b.id: t for b, t in zip(ref.inputs, op.inputs, strict=True)}
        name[ref.outputs[0].id] = op.outputs[0]
        for c in ref.constants:
            name[c.id] = f"k{k}.{c.id}"
            constants.append(replace(c, id=name[c.id]))
        for r in ref.ops:
            for t in r.outputs:
                name.setdefault(t, f"k{k}.{t}")
                tensors[name[t]] = replace(ref.tensors[t], id=name[t])
        for c in ref.constants:
            tensors[name[c.id]] = replace(ref.tensors[c.id], id=name[c.id])
        for r in ref.ops:
            ops.append(
                TracedOp(
                    r.primitive,
                    r.args,
                    tuple(name[t] for t in r.inputs),
                    tuple(name[t] for t in r.outputs),
                )
            )
            paths.append(path)
    return replace(
        phase,
        ops=ops,
        tensors=tensors,
        constants=constants,
        module_paths=paths if old_paths is not None else None,
    )
