"""Execute one phase of a plan verbatim: the plan's primitives, segment by segment.

For each sync point the runner creates the segment's ops (one MLX primitive per plan op, lazily),
drops its own references to every tensor whose last reader is in that segment -- so MLX frees each
buffer right after its interval and can update the KV cache in place -- and calls ``mx.eval`` on
exactly the sync point's ``evaluate`` list, in order. MLX then runs the segment in the order the
compiler replayed, which is the plan's slot order.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dctms.runner.primitives import apply_op, args_from_json, dtype_from_name
from dctms.schema.io import from_json_value
from dctms.schema.types import Phase


@dataclass(frozen=True)
class _Step:
    primitive: str
    args: list
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]


@dataclass(frozen=True)
class _Segment:
    steps: tuple[_Step, ...]
    drop: tuple[str, ...]  # tensor ids whose last reader is in this segment
    evaluate: tuple[str, ...]


class PhaseProgram:
    """A phase prepared once (decoded arguments, segments, drop lists), run many times."""

    def __init__(self, phase: Phase):
        self.name = phase.name
        self.inputs = [(b.id, b.kind, b.name) for b in phase.inputs]
        self.outputs = [(b.id, b.kind, b.name) for b in phase.outputs]
        self.constants = {
            c.id: mx.array(from_json_value(c.value), dtype=dtype_from_name(c.dtype)).reshape(
                c.shape
            )
            for c in phase.constants
        }
        mx.eval(list(self.constants.values()))
        tensors = {t.id: t for t in phase.tensors}
        slot_of = {i: s for s, members in enumerate(phase.slots) for i in members}
        bounds = [sp.slot for sp in phase.sync_points]
        segment_of_slot = {}
        k = 0
        for s in range(len(phase.slots)):
            while s > bounds[k]:
                k += 1
            segment_of_slot[s] = k
        ops_by_segment: list[list[_Step]] = [[] for _ in bounds]
        last_segment: dict[str, int] = {}
        order = sorted(phase.ops, key=lambda op: (slot_of[op.index], op.index))
        for op in order:
            seg = segment_of_slot[slot_of[op.index]]
            ops_by_segment[seg].append(
                _Step(
                    op.primitive,
                    args_from_json(op.args, op.primitive),
                    tuple(op.inputs),
                    tuple(op.outputs),
                    tuple(tuple(tensors[t].shape) for t in op.outputs),
                    tuple(dtype_from_name(tensors[t].dtype) for t in op.outputs),
                )
            )
            for t in op.inputs:
                last_segment[t] = seg
            for t in op.outputs:
                last_segment.setdefault(t, seg)
        keep = set(self.constants) | {b.id for b in phase.inputs if b.kind == "weight"}
        kept_outputs = {b.id for b in phase.outputs}
        drops: list[list[str]] = [[] for _ in bounds]
        for t, seg in last_segment.items():
            if t not in keep and t not in kept_outputs:
                drops[seg].append(t)
        self.segments = [
            _Segment(tuple(ops_by_segment[k]), tuple(sorted(drops[k])), tuple(sp.evaluate))
            for k, sp in enumerate(phase.sync_points)
        ]

    def run(
        self, feeds: dict[str, mx.array], weights: dict[str, mx.array], state: dict[str, mx.array]
    ) -> dict[str, mx.array]:
        """Run the phase. ``state`` entries are *moved* in (so MLX may update them in place) and the
        updated arrays are put back; returns the phase outputs of kind ``output`` by name."""
        env: dict[str, mx.array] = dict(self.constants)
        for tid, kind, name in self.inputs:
            if kind == "weight":
                env[tid] = weights[name]
            elif kind == "state":
                env[tid] = state.pop(name)
            else:
                env[tid] = feeds[name]
        for seg in self.segments:
            for step in seg.steps:
                outs = apply_op(
                    step.primitive,
                    step.args,
                    [env[t] for t in step.inputs],
                    step.shapes,
                    step.dtypes,
                )
                for t, arr in zip(step.outputs, outs, strict=True):
                    env[t] = arr
            for t in seg.drop:
                env.pop(t, None)
            mx.eval([env[t] for t in seg.evaluate])
        results: dict[str, mx.array] = {}
        for tid, kind, name in self.outputs:
            if kind == "state":
                state[name] = env.pop(tid)
            else:
                results[name] = env.pop(tid)
        return results
