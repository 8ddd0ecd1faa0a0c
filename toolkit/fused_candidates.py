"""Candidates for pass 1b' (``toolkit.fused_kernels``): where the CPU trace looks like MLX's
composite of an ``mx.fast`` call, and the call's arguments read off the graph.

Only a reading: a candidate is substituted once MLX's own composite for its arguments matches it op
for op (``fused_kernels``). Each reader walks from an anchor the composite always has -- rms_norm's
``Sqrt [rsqrt]``, rope's ``Concatenate`` of the rotated halves, attention's precise ``Softmax`` --
to the call's inputs and constants (mlx/fast.cpp, v0.32.1: rms_norm 90-106, rope 434-518,
scaled_dot_product_attention 717-824), and yields every reading the graph allows (a rotary base
near the one its constant records, the attention scale before its rounding to q's dtype, an
array or a causal mask).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dctms.schema.fast_ops import RMS_NORM, ROPE, SDPA
from dctms.toolkit.trace import TracedOp, TracedPhase


@dataclass(frozen=True)
class Candidate:
    primitive: str
    args: tuple
    inputs: tuple[str, ...]  # phase tensor ids, in the fast call's input order
    output: str


class Graph:
    def __init__(self, phase: TracedPhase):
        self.phase = phase
        self.producer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = defaultdict(list)
        for i, op in enumerate(phase.ops):
            for t in op.outputs:
                self.producer[t] = i
            for t in op.inputs:
                self.readers[t].append(i)
        self.constants = {c.id: c for c in phase.constants}

    def op(self, t: str) -> TracedOp | None:
        i = self.producer.get(t)
        return self.phase.ops[i] if i is not None else None

    def made_by(self, t: str, *prims: str) -> TracedOp | None:
        op = self.op(t)
        return op if op is not None and op.primitive in prims else None

    def sole_reader(self, t: str, *prims: str) -> TracedOp | None:
        rs = self.readers.get(t, [])
        if len(rs) != 1:
            return None
        op = self.phase.ops[rs[0]]
        return op if op.primitive in prims else None

    def scalar(self, t: str) -> float | None:
        """The value of a scalar constant ``t`` reaches through broadcasts, or None."""
        while (op := self.made_by(t, "Broadcast")) is not None:
            t = op.inputs[0]
        c = self.constants.get(t)
        return float(c.value[0]) if c is not None and len(c.value) == 1 else None

    def shape(self, t: str) -> tuple[int, ...]:
        return self.phase.tensors[t].shape


def candidates(g: Graph) -> Iterator[Candidate]:
    """Every reading of every anchor in the phase, in op order."""
    for op in g.phase.ops:
        if op.primitive == "Sqrt" and op.args == [True]:
            yield from _rms_norm(g, op)
        elif op.primitive == "Concatenate":
            yield from _rope(g, op)
        elif op.primitive == "Softmax" and op.args == [True]:
            yield from _sdpa(g, op)


def _rms_norm(g: Graph, rsqrt: TracedOp):
    add = g.made_by(rsqrt.inputs[0], "Add")
    if add is None:
        return
    eps = g.scalar(add.inputs[1])
    mean = g.made_by(add.inputs[0], "Multiply")
    total = g.made_by(mean.inputs[0], "Reduce") if mean is not None else None
    square = g.made_by(total.inputs[0], "Square") if total is not None else None
    if eps is None or square is None:
        return
    b = g.sole_reader(rsqrt.outputs[0], "Broadcast")
    scaled = g.sole_reader(b.outputs[0], "Multiply") if b is not None else None
    if scaled is None:
        return
    t = scaled.outputs[0]
    cast = g.sole_reader(t, "AsType")
    if cast is not None:
        t = cast.outputs[0]
    final = g.sole_reader(t, "Multiply")
    if final is None:
        return
    w = final.inputs[1]
    while (wb := g.made_by(w, "Broadcast")) is not None:
        w = wb.inputs[0]
    x = square.inputs[0]
    cast_in = g.made_by(x, "AsType")  # astype(x, float32) of a half-precision x is the composite's
    for xx in ([cast_in.inputs[0]] if cast_in is not None else []) + [x]:
        yield Candidate(RMS_NORM, (eps,), (xx, w), final.outputs[0])


def _rope(g: Graph, concat: TracedOp):
    if len(concat.inputs) < 2:
        return
    first = g.op(concat.inputs[0])
    traditional = False
    if first is not None and first.primitive == "ExpandDims":  # traditional: interleaved halves
        traditional = True
        first = g.op(first.inputs[0])
    if first is None or first.primitive not in ("Subtract", "Add"):
        return
    m1 = g.made_by(first.inputs[0], "Multiply")
    x1 = g.made_by(m1.inputs[0], "Slice") if m1 is not None else None
    cos_b = m1.inputs[1] if m1 is not None else None
    if x1 is None or cos_b is None:
        return
    dims = 2 * g.shape(x1.outputs[0])[-1]
    cos = g.made_by(_skip(g, cos_b, "Broadcast", "AsType"), "Cos")
    theta = g.made_by(cos.inputs[0], "Multiply") if cos is not None else None
    if theta is None:
        return
    pos = g.made_by(_skip(g, theta.inputs[0], "Broadcast", "ExpandDims"), "Multiply")
    inv_freqs = _skip(g, theta.inputs[1], "Broadcast")
    inv = g.made_by(inv_freqs, "Exp")  # from the base: exp(arange * -log(base) / half)
    # or from a freqs array (llama3 scaling): reciprocal(freqs), MLX's divide(1, freqs)
    recip = g.made_by(inv_freqs, "Divide")
    freqs = recip.inputs[1] if recip is not None and g.scalar(recip.inputs[0]) == 1.0 else None
    if pos is None or (inv is None and freqs is None):
        return
    scale = g.scalar(pos.inputs[1])
    added = g.made_by(pos.inputs[0], "Add")
    if scale is None or added is None:
        return
    offset = _skip(g, added.inputs[1], "Broadcast", "AsType", "ExpandDims")
    if offset is None:
        return
    if inv is None:
        bases, extra = [1.0], (freqs,)  # MLX records base 1.0 when freqs are given (fast.cpp:547)
    else:
        freq = g.made_by(inv.inputs[0], "Multiply")
        log_step = g.scalar(freq.inputs[1]) if freq is not None else None
        if log_step is None:
            return
        bases, extra = _bases(log_step, dims // 2), ()
    out = concat.outputs[0]
    reshaped = g.sole_reader(out, "Reshape")
    outs = [out, reshaped.outputs[0]] if reshaped is not None else [out]
    x = x1.inputs[0]
    xs = [x]
    lifted = g.made_by(x, "ExpandDims", "Flatten")
    if lifted is not None:
        xs.append(lifted.inputs[0])
    for base in bases:
        for xx in xs:
            for o in outs:
                yield Candidate(
                    ROPE, (dims, traditional, base, scale, True), (xx, offset, *extra), o
                )


def _skip(g: Graph, t: str, *prims: str) -> str:
    """Back from ``t`` through the one-input ops of ``prims``."""
    while (op := g.made_by(t, *prims)) is not None:
        t = op.inputs[0]
    return t


def _bases(log_step: float, half: int) -> list[float]:
    """Rotary bases whose float32 log(base) / half may be ``log_step``: the nearest integer first
    (mlx-lm's rope_theta), then float32 neighbours of exp(log_step * half)."""
    approx = math.exp(log_step * half)
    out = [float(round(approx))]
    f = np.float32(approx)
    for k in range(-2, 3):
        v = float(f + np.float32(k) * np.spacing(f))
        if v not in out and v > 0:
            out.append(v)
    return out


def _sdpa(g: Graph, softmax: TracedOp):
    scores = softmax.inputs[0]
    masked = g.made_by(scores, "Select", "Add")
    mask = None
    if masked is not None:
        if masked.primitive == "Select":
            mask, scores = masked.inputs[0], masked.inputs[1]
        else:
            scores, mask = masked.inputs
    qk = g.made_by(scores, "Matmul")
    pv = g.sole_reader(softmax.outputs[0], "Matmul")
    if qk is None or pv is None:
        return
    grouped = g.made_by(qk.inputs[0], "Unflatten")
    qs = grouped.inputs[0] if grouped is not None else qk.inputs[0]
    scaled = g.made_by(qs, "Multiply")
    scale = g.scalar(scaled.inputs[0]) if scaled is not None else None
    if scale is None:
        return
    q = scaled.inputs[1]
    k = _back(g, qk.inputs[1], ["Broadcast?", "Transpose", *(["ExpandDims"] if grouped else [])])
    v = _back(g, pv.inputs[1], ["Broadcast?", *(["ExpandDims"] if grouped else [])])
    if k is None or v is None:
        return
    out = pv.outputs[0]
    flat = g.sole_reader(out, "Flatten") if grouped is not None else None
    if flat is not None:
        out = flat.outputs[0]
    want = (*g.shape(q)[:-1], g.shape(k)[2])
    scales = _scales(scale, g.phase.tensors[q].dtype, g.shape(q)[-1])
    if mask is None:
        for s in scales:
            yield Candidate(SDPA, (s, False, False, False), (q, k, v), out)
        return
    m = mask
    while g.shape(m) != want and (op := g.made_by(m, "Unflatten", "ExpandDims")) is not None:
        m = op.inputs[0]
    for s in scales:
        if g.shape(m) == want:
            yield Candidate(SDPA, (s, False, False, False), (q, k, v, m), out)
        yield Candidate(SDPA, (s, True, False, False), (q, k, v), out)  # mask="causal"


def _back(g: Graph, t: str, chain: list[str]) -> str | None:
    for step in chain:
        optional = step.endswith("?")
        op = g.made_by(t, step.rstrip("?"))
        if op is None:
            if optional:
                continue
            return None
        t = op.inputs[0]
    return t


def _scales(value: float, dtype: str, head_dim: int) -> list[float]:
    """The attention scale: 1/sqrt(head_dim) in float32 when the recorded constant is its
    rounding to q's dtype (mlx-lm's scale, which a GPU kernel uses unrounded), else the value."""
    exact = float(np.float32(1.0 / math.sqrt(head_dim)))
    return [exact, value] if exact != value else [value]
