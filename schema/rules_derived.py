"""Verifier rules that re-derive figures from the plan itself and refuse a plan claiming less.

The compiler's memory model decides these figures; the verifier cannot re-run that model (it does
not import the compiler), but where a figure follows from what the plan records it is recomputed
here, so an edit that lowers it (and re-stamps the digest) is still refused:

- ``persistent_state`` (runnable plans: both runner phases): the runner holds every phase's constants and two calls' input arrays
  (one computing, one being built), each with the allocator's slack; ``envelope.persistent`` covers
  at least that. A serial vision plan's features table is one array every prefill call reads: once
  (``schema.vision_bytes.input_copies``).
- ``runtime_floor`` (runnable plans): ``envelope.runtime`` covers at least the runner process's baseline for the
  backend (``RUNTIME_FLOOR``), plus MLX's buffer cache (limited to M_intermediate) when the plan
  keeps one (``allocator_slack`` > 0).
- ``dynamic_scratch``: ``DynamicSlice`` and ``DynamicSliceUpdate`` always allocate an 8-byte offset
  inside the op (MLX computes it as int64), whatever the layouts. (Other ops' scratch depends on
  input layouts the plan does not record: the compiler's model, not re-derived.)
- ``run_ahead``: a tensor lives until its last read *widened* by the plan's
  ``run_ahead_dispatches``: MLX's host may schedule ops that many encoder dispatches ahead of the
  worker before the reader has run, capped at the segment's sync point. Dispatches per op follow
  from the plan: 1 for an op whose outputs are all views (a donated output is not: its op still
  runs a kernel), 3 for ``DynamicSliceUpdate`` and
  ``SliceUpdate``, 1 for a ``Scatter`` into state (a batched decode's KV write), 2 otherwise
  (``dctms.toolkit.memory_model``'s counts). On a GPU target (``target.memory_model``) the budget
  counts kernel ops instead: 0 for an op that may encode no kernel (a view or reshape primitive,
  ``AsType``, an op whose outputs are all views or all empty), 1 for every other
  (``schema.targets.kernel_ops``).
- ``persistent_state`` on a GPU target also covers what the allocator's rounding and cache reuse add
  to every weight and KV array (``schema.targets.overhead``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

from dctms.schema.aliasing import DONATING
from dctms.schema.phase_index import PhaseIndex, PlanIndex
from dctms.schema.rules_runner import runnable
from dctms.schema.sizes import ITEMSIZE, is_arena_tenant, run_ahead_end
from dctms.schema.targets import kernel_ops, overhead
from dctms.schema.vision_bytes import input_copies, vision_phases

Finding = tuple[str, str]

MIB = 2**20
# Resident memory of the runner process outside MLX's own memory (RSS peak - MLX peak): measured
# 132.8 MiB on the CPU backend for `dctms run` of SmolLM2-135M-Instruct float32 with its chat
# template (transformers and tokenizers loaded) and OpenBLAS (2 threads), two runs; rounded up to
# 160 MiB. (The earlier 64 MiB was measured as 38 MiB before chat templates and OpenBLAS.) The
# Metal figure is an estimate. dctms.toolkit.envelope uses these.
RUNTIME_FLOOR = {"cpu": 160 * MIB, "gpu": 192 * MIB}
DYNAMIC_OFFSET_BYTES = 8  # the int64 offset of DynamicSlice / DynamicSliceUpdate
DYNAMIC = ("DynamicSlice", "DynamicSliceUpdate")
# ops the compiler's memory model counts as three encoder dispatches (toolkit.memory_model)
THREE_DISPATCHES = ("DynamicSliceUpdate", "SliceUpdate", "Convolution")


def persistent_state(ix: PlanIndex) -> Iterator[Finding]:
    plan = ix.plan
    if not runnable(plan):
        return  # what the runner holds across its calls: a plan it cannot run holds nothing
    slack, model = plan.target.allocator_slack, plan.target.memory_model
    # A vision call's inputs live only during the call (counted with its arena, see
    # schema.vision_bytes); the features table among them is also prefill's input, counted there.
    variants = vision_phases(plan)
    need = 0
    for phase in plan.phases:
        constants = [_bytes(c.shape, c.dtype) for c in phase.constants]
        inputs = [
            (input_copies(plan, phase, b), _bytes(b.shape, b.dtype))
            for b in phase.inputs
            if b.kind == "input"
        ]
        need += sum(b + overhead(model, b, slack) for b in constants)
        if phase.name not in variants:
            need += sum(copies * (b + overhead(model, b, slack)) for copies, b in inputs)
    what = "the phases' constants and two calls' inputs"
    if model is not None:
        need += rounding_bytes(model, plan)
        what += f" (and the {model.name} allocator's rounding of the weights and KV cache)"
    if plan.envelope.persistent < need:
        yield ("$.envelope.persistent", f"{plan.envelope.persistent}, but {what} need {need}")


def rounding_bytes(model, plan) -> int:
    """What a GPU allocator's rounding and cache reuse add to the weights and KV arrays, each a
    buffer of its own (``schema.targets.overhead``)."""
    arrays = [w.bytes for w in plan.model.weights.tensors]
    arrays += [s.bytes for s in plan.state if s.kind == "kv"]
    return sum(overhead(model, b) for b in arrays)


def _bytes(shape: list[int], dtype: str) -> int:
    return math.prod(shape) * ITEMSIZE.get(dtype, 0)  # an unknown dtype: dtype_known reports it


def runtime_floor(ix: PlanIndex) -> Iterator[Finding]:
    plan, env = ix.plan, ix.plan.envelope
    if not runnable(plan):
        return  # the runner process's floor: only for a plan the runner executes
    floor = RUNTIME_FLOOR.get(plan.target.backend, max(RUNTIME_FLOOR.values()))
    why = f"the runner process's baseline {floor // MIB} MiB"
    if plan.target.allocator_slack > 0:
        floor += env.intermediate
        why += " plus MLX's buffer cache (M_intermediate)"
    if env.runtime < floor:
        yield "$.envelope.runtime", f"{env.runtime}, less than {why} = {floor}"


def dynamic_scratch(ix: PlanIndex) -> Iterator[Finding]:
    for px in ix.phases:
        for k, op in enumerate(px.phase.ops):
            if op.primitive in DYNAMIC and op.scratch < DYNAMIC_OFFSET_BYTES:
                yield (
                    f"{px.op_path(k)}.scratch",
                    f"{op.scratch}, but {op.primitive} allocates a {DYNAMIC_OFFSET_BYTES}-byte "
                    "offset",
                )


def run_ahead(ix: PlanIndex) -> Iterator[Finding]:
    budget = ix.plan.target.run_ahead_dispatches
    if budget <= 0:
        return
    kernels = ix.plan.target.memory_model is not None
    for px in ix.phases:
        yield from _phase_run_ahead(px, budget, kernels)


def op_dispatches(phase, order: list[int], kernels: bool) -> list[int]:
    """Per op in execution ``order``: the encoder dispatches the CPU model counts, or with
    ``kernels`` (a GPU target) the kernel ops: 0 for an op making views only, else 1."""
    views = {t.id for t in phase.tensors if t.view_of is not None}
    own_views = {t.id for t in phase.tensors if t.view_of is not None and t.kind != "state"}
    size = {t.id: t.bytes for t in phase.tensors}
    state = {b.id for b in phase.inputs if b.kind == "state"}
    dispatches = []
    for op_position in order:
        op = phase.ops[op_position]
        if kernels:
            views_only = bool(op.outputs) and all(t in own_views for t in op.outputs)
            empty = all(size.get(t, 1) == 0 for t in op.outputs)
            dispatches.append(kernel_ops(op.primitive, views_only, empty))
        elif op.primitive in THREE_DISPATCHES:
            dispatches.append(3)
        elif op.primitive == "Scatter" and op.inputs and op.inputs[0] in state:
            dispatches.append(1)  # into the donated state: no copy kernel, one scatter
        elif op.outputs and all(t in views for t in op.outputs) and op.primitive not in DONATING:
            dispatches.append(1)
        else:
            dispatches.append(2)
    return dispatches


def _phase_run_ahead(px: PhaseIndex, budget: int, kernels: bool = False) -> Iterator[Finding]:
    phase = px.phase
    order = [px.op_at_index[i] for members in phase.slots for i in members if i in px.op_at_index]
    if len(order) != len(phase.ops) or len(set(order)) != len(order):
        return  # slots_cover reports it
    position_of = {op_position: p for p, op_position in enumerate(order)}
    slot_at = [px.slot_of.get(op_position, 0) for op_position in order]
    tensors = phase.tensors
    dispatches = op_dispatches(phase, order, kernels)
    prefix = [0]
    for d in dispatches:
        prefix.append(prefix[-1] + d)
    sync_slots = sorted(sp.slot for sp in phase.sync_points)
    last = len(order) - 1
    # upto[s]: the last position in a slot <= s (positions run through the slots in order)
    upto, p = [], -1
    for s in range(len(phase.slots)):
        while p + 1 <= last and slot_at[p + 1] <= s:
            p += 1
        upto.append(p)
    segment_end = []
    for q in range(len(order)):
        j = bisect.bisect_left(sync_slots, slot_at[q])
        boundary = sync_slots[j] if j < len(sync_slots) else len(phase.slots) - 1
        segment_end.append(max(upto[min(boundary, len(upto) - 1)], q))

    def widen(k: int) -> int:
        return run_ahead_end(prefix, k, segment_end[k], budget)

    outputs = {b.id for b in phase.outputs}
    for i, t in enumerate(tensors):
        if not is_arena_tenant(t):
            continue
        if t.kind == "scratch":
            owner = getattr(t, "op", None)
            k = position_of.get(px.op_at_index.get(owner, -1)) if owner is not None else None
        else:
            producer = px.producer.get(t.id)
            if producer is None or producer not in position_of:
                continue
            reads = [position_of[c] for c in px.consumers.get(t.id, ()) if c in position_of]
            for v in px.views_of.get(t.id, ()):
                reads += [
                    position_of[c] for c in px.consumers.get(tensors[v].id, ()) if c in position_of
                ]
            k = max([position_of[producer], *reads])
            if t.id in outputs:
                k = last
        if k is None:
            continue
        need = slot_at[widen(k)]
        if len(t.interval) == 2 and t.interval[1] < need:
            yield (
                f"{px.tensor_path(i)}.interval",
                f"ends at slot {t.interval[1]}, but MLX may run {budget} "
                f"{'kernel ops' if kernels else 'dispatches'} ahead of its last read: it lives "
                f"until slot {need}",
            )
