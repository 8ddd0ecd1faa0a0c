"""Pass 3, lifetimes: which tensors own memory, and the slots during which they hold it.

A tensor owns memory when its producing op allocates (``memory_model``); views alias their root and
extend its lifetime; in-place updates of state and the graph's leaves (weights, inputs, constants,
state) are not intermediates.

Interval = [slot of the producer, slot of the last read], widened for MLX's CPU run-ahead: the host
thread allocates an op's output when it *schedules* the op, while inputs are released only when the
worker thread has *run* their last reader. Unchecked, up to 110 encoder dispatches can be
outstanding (mlx/transforms.cpp MAX_ACTIVE_TASKS = 10 tasks x mlx/backend/cpu/encoder.h
DISPATCHES_PER_TASK = 10, plus a partly filled task). But after every op the host also waits while
MLX's active memory is above its memory limit and any full task is outstanding; the runner sets that
limit to the provable envelope minus the largest single op's allocation. So when the host allocates
for op j, either active memory is within the limit (and op j adds at most the largest allocation),
or the worker is at most one partial task -- ``RUN_AHEAD_DISPATCHES`` dispatches -- behind: a
tensor read last by op k may still be alive at op j when fewer than that many dispatches lie
between them. A sync point (``mx.eval`` returning) drains everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from dctms.schema.sizes import nbytes, run_ahead_end
from dctms.toolkit.memory_model import Layout, op_memory, row_major
from dctms.toolkit.schedule import Schedule
from dctms.toolkit.trace import TracedPhase

RUN_AHEAD_DISPATCHES = 10  # one partial task (<= 9 dispatches) plus the reading op's own


@dataclass
class Life:
    id: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str  # intermediate | output | state | view | scratch
    root: str | None  # for views: the tensor owning the bytes (may be a leaf)
    start: int  # execution position of the producer
    end: int  # execution position of the last read (before run-ahead widening)
    scratch_of: int | None = None  # execution position of the op owning this scratch


@dataclass
class PhaseLives:
    lives: dict[str, Life]  # op outputs and scratch pseudo-tensors, by id
    slot_interval: dict[str, tuple[int, int]]
    scratch: list[int]  # scratch bytes per execution position
    dispatches: list[int]


def analyse(phase: TracedPhase, sched: Schedule) -> PhaseLives:
    ops = phase.ops
    order = sched.order
    n = len(order)
    slot_of = [0] * n
    for s, positions in enumerate(sched.slots):
        for p in positions:
            slot_of[p] = s
    segment_end = [0] * n
    p = 0
    for seg in sched.segments:
        end = p + len(seg.ops) - 1
        for q in range(p, end + 1):
            segment_end[q] = end
        p = end + 1

    layout: dict[str, Layout] = {}
    leaf_kind: dict[str, str] = {}
    for b in phase.inputs:
        layout[b.id] = row_major(b.shape)
        leaf_kind[b.id] = b.kind
    for c in phase.constants:
        layout[c.id] = row_major(c.shape)
        leaf_kind[c.id] = "constant"

    outputs = {b.id: b.kind for b in phase.outputs}
    lives: dict[str, Life] = {}
    keep_alive: list[tuple[str, str]] = []  # (source root, copy) pairs
    scratch = [0] * n
    dispatches = [1] * n

    def root_of(t: str) -> str:
        life = lives.get(t)
        return life.root if life is not None and life.kind in ("view", "state") else t

    for pos, i in enumerate(order):
        op = ops[i]
        in_t = [phase.tensors[t] for t in op.inputs]
        mem = op_memory(
            op.primitive,
            op.args,
            [layout[t] for t in op.inputs],
            [t.dtype for t in in_t],
            [phase.tensors[t].shape for t in op.outputs],
            [phase.tensors[t].dtype for t in op.outputs],
            [leaf_kind.get(root_of(t)) == "state" for t in op.inputs],
        )
        scratch[pos] = mem.scratch
        dispatches[pos] = mem.dispatches
        for t in op.inputs:
            _read(lives, t, pos, root_of)
        for t, eff in zip(op.outputs, mem.effects, strict=True):
            info = phase.tensors[t]
            size = nbytes(info.shape, info.dtype)
            layout[t] = eff.layout
            if eff.kind in ("view", "inplace"):
                kind = "view" if eff.kind == "view" else "state"
                lives[t] = Life(
                    t, info.shape, info.dtype, size, kind, root_of(op.inputs[eff.source]), pos, pos
                )
            else:
                kind = "output" if outputs.get(t) == "output" else "intermediate"
                lives[t] = Life(t, info.shape, info.dtype, size, kind, None, pos, pos)
                if eff.keep_source:
                    keep_alive.append((root_of(op.inputs[eff.source]), t))
        if mem.scratch:
            sid = f"scratch.{pos}"
            lives[sid] = Life(
                sid, (mem.scratch,), "uint8", mem.scratch, "scratch", None, pos, pos, scratch_of=pos
            )

    last = n - 1
    for t in outputs:
        if t in lives:
            _read(lives, t, last, root_of)
    # A predicted copy keeps its source alive as long as itself (sound if MLX viewed instead).
    for src, copy in reversed(keep_alive):
        if src in lives:
            lives[src].end = max(lives[src].end, lives[copy].end)

    # Run-ahead widening, in execution positions, capped at the segment's sync point.
    prefix = [0] * (n + 1)
    for q in range(n):
        prefix[q + 1] = prefix[q] + dispatches[q]

    def widen(k: int) -> int:
        return run_ahead_end(prefix, k, segment_end[k], RUN_AHEAD_DISPATCHES)

    slot_interval: dict[str, tuple[int, int]] = {}
    for t, life in lives.items():
        if life.kind in ("view", "state"):
            end = life.end  # the root carries the memory; views keep their own read interval
        else:
            end = widen(life.end)
        slot_interval[t] = (slot_of[life.start], slot_of[end])
    return PhaseLives(lives, slot_interval, scratch, dispatches)


def _read(lives: dict[str, Life], t: str, pos: int, root_of) -> None:
    life = lives.get(t)
    if life is None:
        return  # a leaf
    life.end = max(life.end, pos)
    root = root_of(t)
    if root != t and root in lives:
        lives[root].end = max(lives[root].end, pos)
