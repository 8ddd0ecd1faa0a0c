"""Verifier rule ``index_safety``: at every point a phase runs at, every shape MLX infers holds and
every access by a value lies inside the array it addresses.

MLX's ``DynamicSlice``, ``DynamicSliceUpdate``, ``Gather``, ``GatherAxis``, ``ScatterAxis`` and
``Scatter`` do not bounds-check their index values on the CPU: an index past the array reads or writes freed
memory (a segmentation fault, or silent garbage). A shape that stops matching at a length point
(an affine function with the wrong slope) is an MLX error mid-call. So, for each phase, at the
bound and at every verified point of ``Phase.lengths``, the rule evaluates the phase abstractly
(``abstract_eval``: the arguments and shapes the runner uses there, and the range of values every
integer tensor can hold) and requires:

- MLX accepts every op's shapes there, and every tensor is at most its planned shape (exactly it
  at the bound), so that the planned bytes hold;
- every index a memory-addressing op reads has a known range inside its operand: a start plus the
  slice never past the axis, a gathered index below the axis' size, nothing negative.

The values the runner feeds (``RUNTIME_RANGES``) are bounded by the runner itself, at run time:
token ids below ``model.vocab_size`` (``dctms.runner.request``), the write position at most
``bounds.kv_capacity`` minus the phase's tokens (``runner.session.check_allocation``), the last
row below the call's tokens, a features-table row below ``vision.feature_rows``, and a sampling
plan's ``recent`` and ``bias_ids`` ids below ``vocab_size``, ``top_k`` below it and ``context``
within the window (``runner.sampling``'s checks). Position writes
into the KV cache (``access.state_writes``: plain, ring or clamped) are the ``state_capacity``
rule's; every other index -- a constant, or arithmetic on these values -- is this rule's.
"""

from __future__ import annotations

from collections.abc import Iterator

from dctms.schema.abstract_eval import EvalError, OpAt, Range, evaluate
from dctms.schema.access import state_writes
from dctms.schema.phase_index import PhaseIndex, PlanIndex
from dctms.schema.rules_runner import RESULT, runnable
from dctms.schema.sampling import samples
from dctms.schema.slotted import slotted

Finding = tuple[str, str]

ADDRESSING = frozenset(
    {"DynamicSlice", "DynamicSliceUpdate", "Gather", "GatherAxis", "ScatterAxis", "Scatter"}
)


def runtime_ranges(ix: PlanIndex, px: PhaseIndex, point) -> dict[str, Range]:
    """What the runner feeds each per-call input of ``px`` at ``point``, by binding name."""
    plan, phase = ix.plan, px.phase
    tokens = phase.tokens
    if point is not None and phase.lengths is not None and "tokens" in phase.lengths.names:
        tokens = point[phase.lengths.names.index("tokens")]
    ranges: dict[str, Range] = {
        "tokens": (0, plan.model.vocab_size - 1),
        "position": (0, max(0, plan.bounds.kv_capacity - phase.tokens)),
        "last_index": (0, max(0, tokens - 1)),
    }
    if slotted(plan.bounds):  # a plan in slots (toolkit.slots): runner.batch bounds both
        ranges["slot"] = (0, plan.bounds.batch - 1)
        ranges["source"] = ranges["slot"]  # a slot move's row read (toolkit.slot_move)
        # a busy row's position, or the spare last one where a free row's step writes
        ranges["positions"] = (0, max(0, plan.bounds.kv_capacity - 1))
    if plan.bounds.prefix_blocks > 0:  # runner.prefix_cache: a block of the pool
        ranges["block"] = (0, plan.bounds.prefix_blocks - 1)
    if samples(plan):  # compile --sampling: runner.sampling checks each before it feeds it
        vocab = (0, plan.model.vocab_size - 1)
        recent = next((b for b in phase.inputs if b.name == "recent"), None)
        window = recent.shape[0] if recent is not None and recent.shape else 1
        # the window holds prompt ids (validated) and fed-back tokens (proven below vocab_size)
        ranges.update(recent=vocab, bias_ids=vocab, top_k=vocab, context=(1, window))
    if plan.vision is not None:
        v = plan.vision
        ranges["image_rows"] = (0, v.feature_rows - 1)
        ranges["row"] = (0, (v.images - 1) * v.tokens_per_image)  # image k at k * tokens
    return ranges


def index_safety(ix: PlanIndex) -> Iterator[Finding]:
    """Shapes that MLX accepts and accesses inside their operands, at every point of every phase."""
    for px in ix.phases:
        position_writes = {w.op_position for w in state_writes(px.phase)[0]}
        # The runner feeds a phase's next_token back as the next call's token ids.
        fed_back = {b.id for b in px.phase.outputs if b.kind == "output" and b.name == RESULT}
        fed_back = fed_back if runnable(ix.plan) else set()
        recorded = {t.id: t.shape for t in px.phase.tensors}
        try:
            ranges = lambda p, px=px: runtime_ranges(ix, px, p)  # noqa: E731
            for op in evaluate(px.phase, ranges, strict_bound=runnable(ix.plan)):
                # at the bound the evaluation keeps the plan's shapes (see abstract_eval)
                found = [] if op.exact else list(_planned_size(px, op, recorded))
                if op.primitive in ADDRESSING and op.position not in position_writes:
                    found += _access(px, op)
                found += _fed_back(px, op, fed_back, ix.plan.model.vocab_size)
                if found:
                    yield found[0][0], _where(op.point) + found[0][1]
                    break  # one finding per phase: the rest often follows from it
        except EvalError as err:
            op = err.op if err.op is not None else 0
            name = px.phase.ops[op].primitive if op < len(px.phase.ops) else "?"
            yield px.op_path(op), f"{_where(err.point)}{name}: {err}"


def _fed_back(px: PhaseIndex, op: OpAt, fed_back: set[str], vocab: int) -> list[Finding]:
    """A generated id is an index the next call gathers by: it must lie below ``vocab_size``
    (which rule ``vocabulary`` proves the embedding holds)."""
    outputs = px.phase.ops[op.position].outputs
    for t, r in zip(outputs, op.out_ranges, strict=False):
        if t in fed_back and (r is None or r[0] < 0 or r[1] > vocab - 1):
            what = "not bounded by the plan" if r is None else f"ranges over [{r[0]}, {r[1]}]"
            return [(px.op_path(op.position),
                     f"the generated id {t} is {what}, outside [0, {vocab - 1}]: the next call "
                     "gathers by it")]  # fmt: skip
    return []


def _where(point) -> str:
    return "" if point is None else f"at lengths point {list(point)}: "


def _planned_size(px: PhaseIndex, op: OpAt, recorded: dict) -> Iterator[Finding]:
    for t, got in zip(px.phase.ops[op.position].outputs, op.outputs, strict=False):
        planned = recorded.get(t)
        if planned is None:
            continue
        fits = len(got) == len(planned) and all(
            g == p if op.exact else g <= p for g, p in zip(got, planned, strict=True)
        )
        if not fits:
            yield (
                px.op_path(op.position),
                f"{op.primitive} makes {t} of shape {list(got)}, the plan records "
                f"{list(planned)}" + ("" if op.exact else " (at most)"),
            )


def _access(px: PhaseIndex, op: OpAt) -> Iterator[Finding]:
    """The index checks of one memory-addressing op."""
    prim, args, shapes, ranges = op.primitive, op.args, op.shapes, op.ranges
    where = px.op_path(op.position)
    try:
        if prim in ("DynamicSlice", "DynamicSliceUpdate", "Gather"):
            extent = list(args[1]) if prim != "DynamicSliceUpdate" else list(shapes[1])
            if len(extent) != len(shapes[0]) or any(
                not 0 <= e <= n for e, n in zip(extent, shapes[0], strict=True)
            ):
                yield where, f"{prim} of extent {extent} outside its operand {list(shapes[0])}"
                return
        if prim in ("DynamicSlice", "DynamicSliceUpdate"):
            axes = list(args[0])
            start = ranges[-1]
            for ax in axes:
                problem = _inside(start, shapes[0][ax] - extent[ax], "start")
                if problem:
                    yield (
                        where,
                        (
                            f"{prim} on axis {ax} of size {shapes[0][ax]} (extent {extent[ax]}): "
                            f"{problem}"
                        ),
                    )
        elif prim == "Gather":
            axes, sizes = list(args[0]), list(args[1])
            for ax, r in zip(axes, ranges[1:], strict=False):
                problem = _inside(r, shapes[0][ax] - sizes[ax], "index")
                if problem:
                    yield where, f"Gather on axis {ax} of size {shapes[0][ax]}: {problem}"
        elif prim == "Scatter":
            axes = list(args[1])
            sizes = shapes[-1][len(shapes[-1]) - len(shapes[0]) :]
            for ax, r in zip(axes, ranges[1:-1], strict=False):
                problem = _inside(r, shapes[0][ax] - sizes[ax], "index")
                if problem:
                    yield where, f"Scatter on axis {ax} of size {shapes[0][ax]}: {problem}"
        elif prim in ("GatherAxis", "ScatterAxis"):
            ax = args[0] if prim == "GatherAxis" else args[1]
            size = shapes[0][ax]
            problem = _inside(ranges[1], size - 1, "index")
            if problem:
                yield where, f"{prim} on axis {ax} of size {size}: {problem}"
    except (IndexError, TypeError):
        yield where, f"{prim} with arguments {args!r} does not match its inputs {shapes}"


def _inside(r: Range, most: int, what: str) -> str:
    if r is None:
        return f"the {what} is not bounded by the plan (nor fed by the runner)"
    lo, hi = r
    if lo < 0 or hi > most:
        return f"the {what} ranges over [{lo}, {hi}], outside [0, {max(most, -1)}]"
    return ""
