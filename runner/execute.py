"""Execute one phase of a plan verbatim: the plan's primitives, segment by segment.

For each sync point the runner creates the segment's ops (one MLX primitive per plan op, lazily),
drops its own references to every tensor whose last reader is in that segment -- so MLX frees each
buffer right after its interval and can update the KV cache in place -- and calls ``mx.eval`` on
exactly the sync point's ``evaluate`` list, in order. MLX then runs the segment in the order the
compiler replayed, which is the plan's slot order.

A phase with ``lengths`` runs at any of its verified points (``runner.lengths``): the same
primitives, with the arguments the plan's affine functions give at that point (a *variant*).

Per-call Python work that does not depend on the token is done once per variant:

* the first run of the bound variant goes through ``apply_op``, which checks every output's shape
  and dtype against the plan; later runs call each primitive's handler directly;
* every other run records each segment's graph (once per variant) with MLX's exporter and imports it
  (``mx.export_function`` / ``mx.import_function``); from then on a call re-creates the segment's
  primitives in C++ (``compile_replace``: the recorded primitives, inputs in the same order) instead
  of one Python call per op -- most of a small model's decode step.

``prepare`` does both ahead of any call, for the points a session will use: the bound's check and
every recording, on placeholders (graphs are built, nothing is computed), so no call pays for them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from dctms.runner import primitives
from dctms.runner.collectives import has_collectives
from dctms.runner.lengths import LengthTable
from dctms.runner.primitives import apply_op, args_from_json, dtype_from_name
from dctms.schema.types import Phase

RECORD_AFTER = 0  # runs of a variant in Python before its graph is recorded (the checked bound run aside)
_REPLAYS: dict[int, bool] = {}  # thread id -> whether an imported graph evaluates there


def replays_here() -> bool:
    """Whether a graph recorded with ``mx.export_function`` and imported evaluates on this thread.
    MLX 0.32 imports a graph onto the default stream of the thread that first evaluated anything,
    and another thread has no encoder for that stream ("There is no Stream(cpu, 0) in current
    thread"): e.g. a server's worker thread in a process whose main thread already ran MLX. There
    the runner re-creates each segment's primitives in Python instead (the same graph, slower to
    build). Checked once per thread, on a one-element function."""
    import threading

    key = threading.get_ident()
    if key not in _REPLAYS:
        try:
            with tempfile.TemporaryDirectory(prefix="dctms-replay-probe-") as tmp:
                path = os.path.join(tmp, "probe.mlxfn")
                mx.export_function(path, lambda x: x + 1, mx.zeros((1,), mx.int32))
                mx.eval(mx.import_function(path)(mx.zeros((1,), mx.int32)))
            _REPLAYS[key] = True
        except RuntimeError:
            _REPLAYS[key] = False
    return _REPLAYS[key]


@dataclass(frozen=True)
class _Step:
    index: int  # the plan op's index (its position in Phase.ops)
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


def _step(index, primitive, args, inputs, outputs, shapes, dtypes) -> _Step:
    direct = _direct(
        primitive, args, shapes[0] if shapes else (), dtypes[0] if dtypes else mx.float32
    )
    return _Step(index, primitive, args, inputs, outputs, shapes, dtypes, direct)


@dataclass(frozen=True)
class _Segment:
    drop: tuple[str, ...]  # tensor ids whose last reader is in this segment
    drop_recorded: tuple[str, ...]  # of those, the ones defined before it (what a replay reads)
    evaluate: tuple[str, ...]
    reads: tuple[str, ...]  # ids defined before this segment (leaves, earlier segments) it reads
    keeps: tuple[str, ...]  # ids it defines that are read after it (its evaluate list first)


class _Variant:
    """The phase at one length point: its steps per segment, and their recorded graphs."""

    def __init__(self, point: tuple[int, ...], steps: list[tuple[_Step, ...]]):
        self.point, self.steps = point, steps
        self.runs = 0
        self.replays: list[Callable | None] = [None] * len(steps)


class PhaseProgram:
    """A phase prepared once (decoded arguments, segments, drop lists), run many times."""

    def __init__(self, phase: Phase, replay: bool = True):
        self.name = phase.name
        self.inputs = [(b.id, b.kind, b.name) for b in phase.inputs]
        # Per-call work that does not depend on the call, done once: the inputs by kind, the
        # env of constants and weights (``_static_env``), the ids each call waits for first.
        self._weight_inputs = [(b.id, b.name) for b in phase.inputs if b.kind == "weight"]
        self._state_inputs = [(b.id, b.name) for b in phase.inputs if b.kind == "state"]
        self._feed_inputs = [
            (b.id, b.name) for b in phase.inputs if b.kind not in ("weight", "state")
        ]
        self._waited = [tid for tid, kind, _ in self.inputs if kind != "weight"]
        self._static: dict[str, mx.array] = {}
        self._static_for: dict[str, mx.array] | None = None
        self._feeds = {  # per-call inputs: shape at the bound, dtype (for placeholders)
            b.id: (tuple(b.shape), dtype_from_name(b.dtype)) for b in phase.inputs if b.kind == "input"
        }
        self.outputs = [(b.id, b.kind, b.name) for b in phase.outputs]
        self.constants = {
            c.id: mx.array(c.value, dtype=dtype_from_name(c.dtype)).reshape(c.shape)
            for c in phase.constants
        }
        mx.eval(list(self.constants.values()))
        self.lengths = LengthTable(phase)
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
        order = sorted(range(len(phase.ops)), key=lambda i: (slot_of[i], i))
        for index in order:
            op = phase.ops[index]
            seg = segment_of_slot[slot_of[index]]
            ops_by_segment[seg].append(
                _step(
                    index,
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
        self.checked = False  # set after the first run of the bound, whose outputs were checked
        self.segments = _segments(ops_by_segment, drops, phase, kept_outputs)
        bound = self.lengths.bound
        self._variants = {bound: _Variant(bound, [tuple(s) for s in ops_by_segment])}
        # MLX's exporter cannot record mlx.distributed's primitives: a rank's phase runs op by op.
        self.replay = (
            replay
            and not has_collectives(op.primitive for op in phase.ops)
            and replays_here()
        )
        self._files = tempfile.TemporaryDirectory(prefix="dctms-replay-") if self.replay else None

    def variant(self, point: tuple[int, ...]) -> _Variant:
        """The phase's steps at a verified length point (made once, then kept)."""
        found = self._variants.get(point)
        if found is None:
            self.lengths.check_point(point)
            base = self._variants[self.lengths.bound]
            steps = []
            for seg_steps in base.steps:
                steps.append(tuple(self._at(step, point) for step in seg_steps))
            found = self._variants[point] = _Variant(point, steps)
        return found

    def _at(self, step: _Step, point: tuple[int, ...]) -> _Step:
        args = self.lengths.args_at(step.index, step.args, point)
        shapes = self.lengths.shapes_at(step.outputs, step.shapes, point)
        if args is step.args and shapes is step.shapes:
            return step
        return _step(
            step.index, step.primitive, args, step.inputs, step.outputs, shapes, step.dtypes
        )

    def feed_shape(self, binding_id: str, bound_shape: Sequence[int], point: tuple[int, ...]):
        """An input binding's shape at ``point`` (the plan's affine places for its axes)."""
        return self.lengths.shapes_at([binding_id], (tuple(bound_shape),), point)[0]

    def prepare(
        self,
        weights: dict[str, mx.array],
        state: dict[str, mx.array],
        points: Iterable[tuple[int, ...]] | None = None,
    ) -> int:
        """Check the bound's outputs against the plan and record every segment at ``points``
        (default: every verified point) now, so that no call pays for either. Builds graphs on
        placeholder feeds and the real weights and state without evaluating anything (nothing is
        computed or allocated; no reference survives). Returns how many points were recorded."""
        wanted = list(dict.fromkeys(self.lengths.points if points is None else points))
        if not self.checked:
            self._build(self.lengths.bound, weights, state, check=True)
            self.checked = True
        if not self.replay:
            return 0
        done = 0
        for point in wanted:
            variant = self.variant(tuple(point))
            if all(r is not None for r in variant.replays):
                continue
            self._build(variant.point, weights, state, check=False, record=True)
            done += 1
        return done

    def _build(self, point, weights, state, check: bool, record: bool = False) -> None:
        """Build (never evaluate) the phase at ``point`` on placeholder feeds, segment by segment:
        through ``apply_op``'s checks, or recording each segment and calling its replay."""
        variant = self.variant(point)
        env: dict[str, mx.array] = dict(self.constants)
        for tid, kind, name in self.inputs:
            if kind == "weight":
                env[tid] = weights[name]
            elif kind == "state":
                env[tid] = state[name]
            else:
                shape, dtype = self._feeds[tid]
                env[tid] = mx.zeros(self.feed_shape(tid, shape, variant.point), dtype=dtype)
        for k, seg in enumerate(self.segments):
            if record:
                replay = variant.replays[k] or self._record(variant, k, env)
                env.update(zip(seg.keeps, replay(*[env[t] for t in seg.reads]), strict=True))
                continue
            _run_steps(variant.steps[k], env, check)

    def run(
        self,
        feeds: dict[str, mx.array],
        weights: dict[str, mx.array],
        state: dict[str, mx.array],
        wait: bool = True,
        point: tuple[int, ...] | None = None,
    ) -> dict[str, mx.array]:
        """Run the phase at length ``point`` (default: the bound). ``state`` entries are *moved* in
        (so MLX may update them in place) and the updated arrays are put back; returns the phase
        outputs of kind ``output`` by name.

        Feeds and state may still be computing (the previous call's results): the first segment's
        graph is built meanwhile and evaluated only once they are done. With ``wait=False`` the call
        returns while its last segment computes, so the caller can build the next call."""
        variant = self.variant(self.lengths.bound if point is None else tuple(point))
        if not self.checked and variant.point != self.lengths.bound:
            # The other points run unchecked: the bound's outputs are checked against the plan
            # first (on placeholders, nothing computed), whatever point the first call uses.
            self._build(self.lengths.bound, weights, state, check=True)
            self.checked = True
        env = self._static_env(weights)
        for tid, name in self._state_inputs:
            env[tid] = state.pop(name)
        for tid, name in self._feed_inputs:
            env[tid] = feeds[name]
        check = not self.checked and variant.point == self.lengths.bound
        recorded = self.replay and not check and variant.runs >= RECORD_AFTER
        # Whatever a previous call left computing must finish before this call evaluates anything.
        pending: list[mx.array] | None = [env[tid] for tid in self._waited]
        for k, seg in enumerate(self.segments):
            # Building this segment's graph allocates nothing, so it overlaps the previous
            # segment's computation; its evaluation starts only once that one has drained.
            if recorded:
                replay = variant.replays[k] or self._record(variant, k, env)
                # No reference to the inputs survives the call (a KV cache array held here would
                # not be updated in place but copied).
                env.update(zip(seg.keeps, replay(*[env[t] for t in seg.reads]), strict=True))
            else:
                _run_steps(variant.steps[k], env, check)
            # A recorded segment's own tensors never enter env: only what it reads can be dropped.
            for t in seg.drop_recorded if recorded else seg.drop:
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
        self.checked = self.checked or check
        variant.runs += 1
        return results

    def _static_env(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A fresh env holding the constants and weight bindings (built once per weights dict)."""
        if self._static_for is not weights:
            static = dict(self.constants)
            static.update((tid, weights[name]) for tid, name in self._weight_inputs)
            self._static, self._static_for = static, weights
        return dict(self._static)

    def _record(self, variant: _Variant, k: int, env: dict[str, mx.array]) -> Callable:
        """Record segment ``k`` of ``variant`` once (MLX's exporter traces the steps' handlers on
        placeholders shaped like the inputs; nothing is computed) and import it."""
        seg, steps = self.segments[k], variant.steps[k]

        def build(*xs: mx.array) -> list[mx.array]:
            local = dict(zip(seg.reads, xs, strict=True))
            for step in steps:
                outs = step.direct([local[t] for t in step.inputs])
                local.update(zip(step.outputs, outs, strict=True))
            return [local[t] for t in seg.keeps]

        name = "_".join(map(str, variant.point)) or "bound"
        path = os.path.join(self._files.name, f"{self.name}.{name}.{k}.mlxfn")
        mx.export_function(path, build, *[env[t] for t in seg.reads])
        variant.replays[k] = mx.import_function(path)
        return variant.replays[k]


def _run_steps(steps, env: dict[str, mx.array], check: bool) -> None:
    """Build ``steps``' graphs into ``env``: through ``apply_op``'s shape checks, or directly."""
    for step in steps:
        inputs = [env[t] for t in step.inputs]
        if check:
            outs = apply_op(step.primitive, step.args, inputs, step.shapes, step.dtypes)
        else:
            outs = step.direct(inputs)
        env.update(zip(step.outputs, outs, strict=True))


def _segments(
    ops_by_segment: list[list[_Step]], drops: list[list[str]], phase: Phase, kept: set[str]
) -> list[_Segment]:
    defined_in: dict[str, int] = {}
    for k, steps in enumerate(ops_by_segment):
        for step in steps:
            for t in step.outputs:
                defined_in[t] = k
    read_after: list[set[str]] = [set() for _ in ops_by_segment]
    for k, steps in enumerate(ops_by_segment):
        for step in steps:
            for t in step.inputs:
                for j in range(defined_in.get(t, k), k):
                    read_after[j].add(t)
    segments = []
    for k, sp in enumerate(phase.sync_points):
        mine = {t for step in ops_by_segment[k] for t in step.outputs}
        reads = {t for step in ops_by_segment[k] for t in step.inputs} - mine
        later = ((read_after[k] | kept) & mine) - set(sp.evaluate)
        segments.append(
            _Segment(
                tuple(sorted(drops[k])),
                tuple(sorted(set(drops[k]) - mine)),
                tuple(sp.evaluate),
                tuple(sorted(reads)),
                (*sp.evaluate, *sorted(later)),
            )
        )
    return segments
