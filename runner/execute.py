"""Execute one phase of a plan verbatim: the plan's primitives, segment by segment.

For each sync point the runner creates the segment's ops (one MLX primitive per plan op, lazily),
drops its own references to every tensor whose last reader is in that segment -- so MLX frees each
buffer right after its interval and can update the KV cache in place -- and calls ``mx.eval`` on
exactly the sync point's ``evaluate`` list, in order. MLX then runs the segment in the order the
compiler replayed, which is the plan's slot order.

The first run of a phase goes through ``apply_op``, which checks every output's shape and dtype
against the plan; shapes are static, so later runs call each primitive's handler directly (the
per-op Python cost is most of a small model's decode step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from dctms.runner import primitives
from dctms.runner.primitives import apply_op, args_from_json, dtype_from_name
from dctms.schema.types import Phase


@dataclass(frozen=True)
class _Step:
    primitive: str
    args: list
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]
    direct: Callable[[list[mx.array]], list[mx.array]]  # the handler, without apply_op's checks


def _direct(primitive: str, args: list, shape: tuple[int, ...], dtype: mx.Dtype) -> Callable:
    if primitive in primitives._CREATION:
        make = primitives._CREATION[primitive]
        return lambda xs: [make(args, xs, shape, dtype)]
    handler = primitives._HANDLERS.get(primitive)
    if handler is None:  # not executable here: apply_op raises the DctmsError that says so
        return lambda xs: apply_op(primitive, args, xs, [shape], [dtype])

    def call(xs: list[mx.array]) -> list[mx.array]:
        out = handler(args, xs)
        return out if isinstance(out, list) else [out]

    return call


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
            c.id: mx.array(c.value, dtype=dtype_from_name(c.dtype)).reshape(
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
            args = args_from_json(op.args, op.primitive)
            shapes = tuple(tuple(tensors[t].shape) for t in op.outputs)
            dtypes = tuple(dtype_from_name(tensors[t].dtype) for t in op.outputs)
            direct = _direct(
                op.primitive, args, shapes[0] if shapes else (), dtypes[0] if dtypes else mx.float32
            )
            ops_by_segment[seg].append(
                _Step(
                    op.primitive, args, tuple(op.inputs), tuple(op.outputs), shapes, dtypes, direct
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
        self.checked = False  # set after the first run, whose outputs apply_op checked
        self.segments = [
            _Segment(tuple(ops_by_segment[k]), tuple(sorted(drops[k])), tuple(sp.evaluate))
            for k, sp in enumerate(phase.sync_points)
        ]

    def run(
        self,
        feeds: dict[str, mx.array],
        weights: dict[str, mx.array],
        state: dict[str, mx.array],
        wait: bool = True,
    ) -> dict[str, mx.array]:
        """Run the phase. ``state`` entries are *moved* in (so MLX may update them in place) and the
        updated arrays are put back; returns the phase outputs of kind ``output`` by name.

        Feeds and state may still be computing (the previous call's results): the first segment's
        graph is built meanwhile and evaluated only once they are done. With ``wait=False`` the call
        returns while its last segment computes, so the caller can build the next call."""
        env: dict[str, mx.array] = dict(self.constants)
        for tid, kind, name in self.inputs:
            if kind == "weight":
                env[tid] = weights[name]
            elif kind == "state":
                env[tid] = state.pop(name)
            else:
                env[tid] = feeds[name]
        checked = self.checked
        # Whatever a previous call left computing must finish before this call evaluates anything.
        pending: list[mx.array] | None = [
            env[tid] for tid, kind, _ in self.inputs if kind != "weight"
        ]
        for seg in self.segments:
            # Building this segment's graph allocates nothing, so it overlaps the previous
            # segment's computation; its evaluation starts only once that one has drained.
            for step in seg.steps:
                inputs = [env[t] for t in step.inputs]
                if checked:
                    outs = step.direct(inputs)
                else:
                    outs = apply_op(step.primitive, step.args, inputs, step.shapes, step.dtypes)
                for t, arr in zip(step.outputs, outs, strict=True):
                    env[t] = arr
            for t in seg.drop:
                env.pop(t, None)
            if pending is not None:
                mx.eval(pending)  # the sync point: everything of the previous segment is done
            pending = [env[t] for t in seg.evaluate]
            mx.async_eval(pending)
        if wait and pending is not None:
            mx.eval(pending)
        results: dict[str, mx.array] = {}
        for tid, kind, name in self.outputs:
            if kind == "state":
                state[name] = env.pop(tid)
            else:
                results[name] = env.pop(tid)
        self.checked = True
        return results
