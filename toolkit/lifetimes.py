"""Pass 3, lifetimes: which tensors own memory, and the slots during which they hold it.

A tensor owns memory when its producing op allocates (``memory_model``); views alias their root and
extend its lifetime; in-place updates of state and the graph's leaves (weights, inputs, constants,
state) are not intermediates.

Interval = [slot of the producer, slot of the last read], widened for MLX's CPU run-ahead: the host
thread allocates an op's output when it *schedules* the op, while inputs are released only when the
worker thread has *run* their last reader: a tensor read last by op k may still be alive at op j
when fewer than ``run_ahead`` dispatches lie between them. Two budgets (``schema.sizes``):

* ``FREE_RUN_AHEAD`` (120, the default): MLX never lets more than 10 full tasks be outstanding
  (mlx/transforms.cpp MAX_ACTIVE_TASKS = 10 tasks x mlx/backend/cpu/encoder.h
  DISPATCHES_PER_TASK = 10, plus a partly filled task: ~110, measured up to 57 two-dispatch
  matmuls alive; 120 leaves a margin), whatever the memory. The runner's memory
  limit is then the envelope itself, a brake that never binds.
* ``THROTTLED_RUN_AHEAD`` (10): after every op MLX's host also waits while active memory is above
  its memory limit and any full task is outstanding; the runner sets that limit to the provable
  envelope minus the largest single op's allocation. So when the host allocates for op j, either
  active memory is within the limit (and op j adds at most the largest allocation), or the worker is
  at most one partial task behind. A smaller envelope, but MLX's wait returns at once when one task
  is outstanding, so near the peak the host spins (on 2 cores prefill at the bound ran 2x slower).

A sync point (``mx.eval`` returning) drains everything.

Donation: an elementwise op's output is planned in its input's buffer (a view of that input's root)
when MLX is certain to donate it (``schema.aliasing``): the input is the op's only read of it in the
whole phase, it owns its buffer (an allocation, or itself a donated output), it was made in the same
segment by an op with one output, it is neither a phase output nor in an ``mx.eval`` list, and it
has the output's itemsize and a buffer no more than ``DONATION_SLACK_BYTES`` larger. Then, when MLX's
host reaches the op, nothing but the op holds the input: its producer has been evaluated and
detached, no other op reads it, the runner has dropped its own reference before ``mx.eval`` and
a worker's pending task holds only the inputs of ops it reads (an input donated on is left out of
that set, mlx/backend/cpu/eval.cpp). Any donation left out of the plan only lowers real memory.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from dctms.schema.aliasing import DONATION_SLACK_BYTES
from dctms.schema.fast_ops import FUSED, scratch_bytes
from dctms.schema.gpu_matmul import MATMULS, gpu_matmul_scratch
from dctms.schema.sizes import FREE_RUN_AHEAD, ITEMSIZE, nbytes, run_ahead_end
from dctms.schema.targets import kernel_ops
from dctms.schema.types import MemoryModel
from dctms.toolkit.memory_model import (
    Layout,
    OpMemory,
    donated_layout,
    kernel_copies,
    op_memory,
    row_major,
)
from dctms.toolkit.schedule import Schedule
from dctms.toolkit.trace import TracedPhase


@dataclass(frozen=True)
class MemoryRules:
    """The backend's rules pass 3 plans by: MLX's certain donations (the CPU backend's), and the
    dispatches MLX's host may be ahead of its worker (``schema.sizes``)."""

    donation: bool = True
    run_ahead: int = FREE_RUN_AHEAD
    # A GPU target (schema.targets): ``run_ahead`` counts kernel ops (0 for an op making views
    # only, 1 for any other), the command buffers' unit, instead of CPU encoder dispatches.
    kernels: bool = False
    model: MemoryModel | None = None  # the GPU target's allocator model, recorded in the plan


CPU_RULES = MemoryRules()  # the default: donation and free run-ahead


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


@dataclass(frozen=True)
class GraphFacts:
    """What pass 3 needs of a phase's graph and schedule alone, not of its sizes: the same for the
    phase instantiated at any length (``toolkit.lengths``), so computed once for all of them."""

    slot_of: list[int]  # slot of each execution position
    segment_end: list[int]  # last execution position of each position's segment
    donors: frozenset[str]  # tensors MLX may donate, as far as the graph and sync points say
    # tensors the runner holds past their op: phase outputs and what sync points evaluate (none of
    # them is planned in a donated buffer; the verifier's rule ``donation`` refuses that)
    held: frozenset[str]
    in_dtypes: list[list[str]]  # per execution position, its op's input dtypes
    out_dtypes: list[list[str]]


def graph_facts(phase: TracedPhase, sched: Schedule, rules: MemoryRules = CPU_RULES) -> GraphFacts:
    n = len(sched.order)
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
    dtype = {t: x.dtype for t, x in phase.tensors.items()}
    ops = [phase.ops[i] for i in sched.order]
    held = _held(phase, sched)
    return GraphFacts(
        slot_of,
        segment_end,
        frozenset(_sole_reads(phase, held) if rules.donation else ()),
        frozenset(held),
        [[dtype[t] for t in op.inputs] for op in ops],
        [[dtype[t] for t in op.outputs] for op in ops],
    )


def analyse(
    phase: TracedPhase,
    sched: Schedule,
    rules: MemoryRules = CPU_RULES,
    facts: GraphFacts | None = None,
) -> PhaseLives:
    """Pass 3 on one phase, under ``rules``; ``facts``: ``graph_facts`` of a phase with the same
    graph and schedule (computed here when not given)."""
    if facts is None:
        facts = graph_facts(phase, sched, rules)
    ops = phase.ops
    order = sched.order
    n = len(order)
    slot_of, segment_end, donors = facts.slot_of, facts.segment_end, facts.donors
    tensors = phase.tensors

    layout: dict[str, Layout] = {}
    leaf_kind: dict[str, str] = {}
    for b in phase.inputs:
        layout[b.id] = row_major(b.shape)
        leaf_kind[b.id] = b.kind
    for c in phase.constants:
        layout[c.id] = row_major(c.shape)
        leaf_kind[c.id] = "constant"

    outputs = {b.id: b.kind for b in phase.outputs}
    donated: set[str] = set()  # outputs planned in a donated buffer
    lives: dict[str, Life] = {}
    keep_alive: list[tuple[str, str]] = []  # (source root, copy) pairs
    scratch = [0] * n
    dispatches = [1] * n

    def root_of(t: str) -> str:
        life = lives.get(t)
        return life.root if life is not None and life.kind in ("view", "state") else t

    for pos, i in enumerate(order):
        op = ops[i]
        # What depends on sizes and layouts comes from op_cost and the donor choice below only:
        # toolkit.same_lives replays exactly these to prove length points without this pass.
        mem, scratch[pos], dispatches[pos] = op_cost(
            op.primitive,
            op.args,
            [layout[t] for t in op.inputs],
            [tensors[t].shape for t in op.outputs],
            [leaf_kind.get(root_of(t)) == "state" for t in op.inputs],
            pos,
            facts,
            rules,
        )
        for t in op.inputs:
            _read(lives, t, pos, root_of)
        for t, eff in zip(op.outputs, mem.effects, strict=True):
            info = tensors[t]
            size = nbytes(info.shape, info.dtype)
            layout[t] = eff.layout
            donor = None
            if eff.donors and len(op.outputs) == 1 and t not in facts.held:
                donor = next(
                    (
                        op.inputs[k]
                        for k in eff.donors
                        if _donatable(op.inputs[k], info, pos, donors, donated, lives, segment_end)
                    ),
                    None,
                )
            if donor is not None:
                layout[t] = donated_layout(layout[donor], info.shape)
                lives[t] = Life(t, info.shape, info.dtype, size, "view", root_of(donor), pos, pos)
                donated.add(t)
            elif eff.kind in ("view", "inplace"):
                kind = "view" if eff.kind == "view" else "state"
                lives[t] = Life(
                    t, info.shape, info.dtype, size, kind, root_of(op.inputs[eff.source]), pos, pos
                )
            else:
                kind = "output" if outputs.get(t) == "output" else "intermediate"
                lives[t] = Life(t, info.shape, info.dtype, size, kind, None, pos, pos)
                if eff.keep_source:
                    keep_alive.append((root_of(op.inputs[eff.source]), t))
        if scratch[pos]:
            sid, size = f"scratch.{pos}", scratch[pos]
            lives[sid] = Life(
                sid, (size,), "uint8", size, "scratch", None, pos, pos, scratch_of=pos
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
        return run_ahead_end(prefix, k, segment_end[k], rules.run_ahead)

    slot_interval: dict[str, tuple[int, int]] = {}
    for t, life in lives.items():
        if life.kind in ("view", "state"):
            end = life.end  # the root carries the memory; views keep their own read interval
        else:
            end = widen(life.end)
        slot_interval[t] = (slot_of[life.start], slot_of[end])
    return PhaseLives(lives, slot_interval, scratch, dispatches)


def op_cost(
    primitive: str,
    args: list,
    inputs: list[Layout],
    out_shapes: list[tuple[int, ...]],
    input_is_state: list[bool],
    pos: int,
    facts: GraphFacts,
    rules: MemoryRules,
) -> tuple[OpMemory, int, int]:
    """The op at execution position ``pos``: its memory model (outputs' effects), its scratch bytes
    and the dispatches it counts for the run-ahead. Everything pass 3 derives from sizes and
    layouts goes through here, so ``toolkit.same_lives`` replays exactly what ``analyse`` uses."""
    mem = op_memory(
        primitive,
        args,
        inputs,
        facts.in_dtypes[pos],
        out_shapes,
        facts.out_dtypes[pos],
        input_is_state,
    )
    scratch = mem.scratch
    if primitive in FUSED:  # an mx.fast kernel: what its call may hold besides its output
        scratch = scratch_bytes(
            rules.model,
            primitive,
            [layout.shape for layout in inputs],
            facts.in_dtypes[pos],
            args,
            kernel_copies(primitive, inputs),
        )
    if primitive in MATMULS and rules.model is not None:
        # What the GPU's matmul kernels allocate beside the inputs' copies (schema.gpu_matmul).
        scratch += gpu_matmul_scratch(
            rules.model, primitive, [layout.shape for layout in inputs], facts.in_dtypes[pos],
            out_shapes[0], args,
        )  # fmt: skip
    if rules.kernels:
        views_only = bool(mem.effects) and all(e.kind == "view" for e in mem.effects)
        empty = all(math.prod(s) == 0 for s in out_shapes)
        return mem, scratch, kernel_ops(primitive, views_only, empty)
    return mem, scratch, mem.dispatches


def _read(lives: dict[str, Life], t: str, pos: int, root_of) -> None:
    life = lives.get(t)
    if life is None:
        return  # a leaf
    life.end = max(life.end, pos)
    root = root_of(t)
    if root != t and root in lives:
        lives[root].end = max(lives[root].end, pos)


def _sole_reads(phase: TracedPhase, held: set[str]) -> set[str]:
    """Tensors made by a one-output op, read exactly once in the phase, not ``held`` (phase
    outputs, what ``mx.eval`` is passed): once their reader runs, nothing else can hold them."""
    reads: dict[str, int] = {}
    single: set[str] = set()
    for op in phase.ops:
        for t in op.inputs:
            reads[t] = reads.get(t, 0) + 1
        if len(op.outputs) == 1:
            single.add(op.outputs[0])
    return {t for t in single if reads.get(t) == 1 and t not in held}


def _held(phase: TracedPhase, sched: Schedule) -> set[str]:
    """The phase outputs and every tensor a sync point evaluates."""
    held = {b.id for b in phase.outputs}
    for seg in sched.segments:
        held.update(seg.evaluate)
    return held


def _donatable(
    x: str,
    out,
    pos: int,
    candidates: Collection[str],
    donated: set[str],
    lives: dict[str, Life],
    segment_end: list[int],
) -> bool:
    """Whether MLX is certain to donate input ``x`` to the output ``out`` of the op at ``pos``."""
    life = lives.get(x)
    if x not in candidates or life is None:
        return False
    owns = (life.kind == "intermediate" and life.root is None) or x in donated
    if not owns or segment_end[life.start] != segment_end[pos]:  # made in another segment
        return False
    root = lives[life.root] if x in donated else life
    return (
        ITEMSIZE[life.dtype] == ITEMSIZE[out.dtype]
        and root.bytes <= nbytes(out.shape, out.dtype) + DONATION_SLACK_BYTES
    )
