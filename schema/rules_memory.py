"""Verifier rules about memory: byte counts, intervals, views, buffers and the arena."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from dctms.schema.errors import short_value
from dctms.schema.phase_index import PhaseIndex, PlanIndex, valid_interval
from dctms.schema.sizes import (
    ITEMSIZE,
    align_up,
    is_arena_tenant,
    lower_bound_bytes,
    nbytes,
    num_elements,
    slack_bytes,
)
from dctms.schema.types import Tensor

Finding = tuple[str, str]


def _alignment(ix: PlanIndex) -> int:
    return max(1, ix.plan.target.alignment)


def _tenants(px: PhaseIndex) -> list[tuple[int, Tensor]]:
    """Arena tenants with a usable interval, with their positions in ``phase.tensors``."""
    return [
        (pos, t)
        for pos, t in enumerate(px.phase.tensors)
        if is_arena_tenant(t) and valid_interval(t, px.num_slots)
    ]


def dtype_known(ix: PlanIndex) -> Iterator[Finding]:
    """Every dtype is one MLX has (see ``sizes.ITEMSIZE``)."""
    plan = ix.plan
    named = [("$.bounds.dtype", plan.bounds.dtype), ("$.bounds.kv.dtype", plan.bounds.kv.dtype)]
    named += [
        (f"$.model.weights.tensors[{i}].dtype", w.dtype)
        for i, w in enumerate(plan.model.weights.tensors)
    ]
    named += [
        (f"$.model.weights.tensors[{i}].stored_dtype", w.stored_dtype)
        for i, w in enumerate(plan.model.weights.tensors)
        if w.stored_dtype is not None
    ]
    named += [(f"$.state[{i}].dtype", s.dtype) for i, s in enumerate(plan.state)]
    for px in ix.phases:
        for field in ("inputs", "outputs", "constants", "tensors"):
            for i, item in enumerate(getattr(px.phase, field)):
                named.append((f"{px.path}.{field}[{i}].dtype", item.dtype))
    for path, dtype in named:
        if dtype not in ITEMSIZE:
            yield path, f"unknown dtype {dtype!r}"


def tensor_bytes(ix: PlanIndex) -> Iterator[Finding]:
    """bytes == prod(shape) * itemsize(dtype) for tensors, state and weights."""
    plan = ix.plan
    sized = [(f"$.model.weights.tensors[{i}]", w) for i, w in enumerate(plan.model.weights.tensors)]
    sized += [(f"$.state[{i}]", s) for i, s in enumerate(plan.state)]
    for px in ix.phases:
        sized += [(px.tensor_path(i), t) for i, t in enumerate(px.phase.tensors)]
    for path, item in sized:
        if item.dtype in ITEMSIZE and item.bytes != nbytes(item.shape, item.dtype):
            expected = nbytes(item.shape, item.dtype)
            yield (
                f"{path}.bytes",
                f"{item.bytes} bytes, but shape {item.shape} of {item.dtype} is {expected}",
            )


def constant_size(ix: PlanIndex) -> Iterator[Finding]:
    """A constant's value holds prod(shape) elements (it is the flattened array)."""
    for px in ix.phases:
        for i, c in enumerate(px.phase.constants):
            if len(c.value) != num_elements(c.shape):
                yield (
                    f"{px.path}.constants[{i}].value",
                    f"{len(c.value)} values for shape {c.shape} ({num_elements(c.shape)} elements)",
                )


INT64 = (-(2**63), 2**63 - 1)
_INT_RANGE = {
    **{f"int{b}": (-(2 ** (b - 1)), 2 ** (b - 1) - 1) for b in (8, 16, 32, 64)},
    **{f"uint{b}": (0, 2**b - 1) for b in (8, 16, 32)},
    "uint64": (0, INT64[1]),  # MLX reads a Python integer as int64
    "bool": (0, 1),
}


def constant_values(ix: PlanIndex) -> Iterator[Finding]:
    """A constant's values are numbers its dtype holds: an integer within the range of an integer
    dtype, and for any dtype within int64 (MLX reads a Python integer as int64; past it, building
    the array fails inside MLX)."""
    for px in ix.phases:
        for i, c in enumerate(px.phase.constants):
            lo, hi = _INT_RANGE.get(c.dtype, INT64)
            for k, v in enumerate(c.value):
                problem = _constant_problem(v, c.dtype, lo, hi)
                if problem:
                    yield f"{px.path}.constants[{i}].value[{k}]", problem
                    break  # one finding per constant


def _constant_problem(v: object, dtype: str, lo: int, hi: int) -> str:
    if isinstance(v, bool):
        return ""
    if not isinstance(v, (int, float)):
        return f"{short_value(v)} is not a number"
    integer_dtype = dtype in _INT_RANGE
    if isinstance(v, float):
        if not integer_dtype or (v.is_integer() and lo <= v <= hi):
            return ""
        return f"{short_value(v)} is not a {dtype} value (range {lo}..{hi})"
    if lo <= v <= hi:
        return ""
    if integer_dtype:
        return f"{short_value(v)} is not a {dtype} value (range {lo}..{hi})"
    return f"{short_value(v)} is an integer past int64, which MLX cannot read"


def interval_bounds(ix: PlanIndex) -> Iterator[Finding]:
    """0 <= s <= e < number of slots."""
    for px in ix.phases:
        for i, t in enumerate(px.phase.tensors):
            if not valid_interval(t, px.num_slots):
                yield (
                    f"{px.tensor_path(i)}.interval",
                    f"interval {t.interval} is not [s, e] with 0 <= s <= e < {px.num_slots} (slots)",
                )


def interval_producer(ix: PlanIndex) -> Iterator[Finding]:
    """A tensor's interval starts in the slot of the op that produces it."""
    for px in ix.phases:
        for i, t in enumerate(px.phase.tensors):
            producer = px.producer.get(t.id)
            if producer is None or producer not in px.slot_of or not t.interval:
                continue
            if t.interval[0] != px.slot_of[producer]:
                yield (
                    f"{px.tensor_path(i)}.interval",
                    f"starts at slot {t.interval[0]} but op {producer} produces it in slot {px.slot_of[producer]}",
                )


def interval_last_use(ix: PlanIndex) -> Iterator[Finding]:
    """A tensor lives at least until its last read (consumers and views) and no longer than the
    sync point after that read, which drains everything (widening between the two models MLX's
    run-ahead); phase outputs live until the last slot."""
    for px in ix.phases:
        outputs = px.output_ids("output")
        syncs = sorted(sp.slot for sp in px.phase.sync_points)
        for i, t in enumerate(px.phase.tensors):
            if t.kind == "state" or not valid_interval(t, px.num_slots):
                continue  # state aliases persistent memory and lives on after the phase
            expected, reason = _expected_end(px, t, outputs)
            if expected is None:
                continue
            end = t.interval[1]
            if t.id in outputs or t.kind == "output":
                if end != expected:
                    yield f"{px.tensor_path(i)}.interval", f"ends at slot {end}, but {reason}"
                continue
            if end < expected:
                yield f"{px.tensor_path(i)}.interval", f"ends at slot {end}, but {reason}"
                continue
            k = bisect.bisect_left(syncs, expected)
            if k < len(syncs) and end > syncs[k]:
                yield (
                    f"{px.tensor_path(i)}.interval",
                    f"ends at slot {end}, after the sync point at slot {syncs[k]} that frees it "
                    f"(last read in slot {expected})",
                )


def scratch(ix: PlanIndex) -> Iterator[Finding]:
    """A scratch tensor belongs to the op its ``op`` field names: uint8, shape [bytes], bytes == that
    op's scratch, and every op with scratch bytes has its scratch tensor."""
    for px in ix.phases:
        have: set[int] = set()
        for i, t in enumerate(px.phase.tensors):
            if t.kind != "scratch":
                continue
            position = px.producer.get(t.id)
            if position is None:
                yield f"{px.tensor_path(i)}.op", f"{t.id!r} names op {t.op}, which does not exist"
                continue
            op = px.phase.ops[position]
            have.add(position)
            if t.dtype != "uint8" or t.shape != [t.bytes] or t.view_of is not None:
                yield px.tensor_path(i), "a scratch tensor is uint8 of shape [bytes] and no view"
            if op.scratch != t.bytes:
                yield (
                    f"{px.tensor_path(i)}.bytes",
                    f"{t.bytes} bytes, but op {position} declares {op.scratch} scratch bytes",
                )
        for position, op in enumerate(px.phase.ops):
            if op.scratch and position not in have:
                yield f"{px.op_path(position)}.scratch", f"op {position} has no scratch tensor"


def _expected_end(px: PhaseIndex, t: Tensor, outputs: set[str]) -> tuple[int | None, str]:
    if t.id in outputs or t.kind == "output":
        return (
            px.num_slots - 1,
            f"it is a phase output, live until the last slot ({px.num_slots - 1})",
        )
    end, reason = t.interval[0], "it is never read after its first slot"
    for consumer in px.consumers.get(t.id, []):
        if consumer not in px.slot_of:
            return None, ""  # unscheduled consumer: slots_cover reports it
        if px.slot_of[consumer] > end:
            end, reason = (
                px.slot_of[consumer],
                f"its last reader, op {consumer}, runs in slot {px.slot_of[consumer]}",
            )
    for view_pos in px.views_of.get(t.id, []):
        view = px.phase.tensors[view_pos]
        if valid_interval(view, px.num_slots) and view.interval[1] > end:
            end, reason = (
                view.interval[1],
                f"its view {view.id!r} lives until slot {view.interval[1]}",
            )
    return end, reason


def view_root(ix: PlanIndex) -> Iterator[Finding]:
    """view_of names a root (a non-view tensor, input binding or constant); views own no bytes."""
    for px in ix.phases:
        tensors = px.phase.tensors
        for i, t in enumerate(tensors):
            if t.view_of is None:
                continue
            where = f"{px.tensor_path(i)}.view_of"
            if t.view_of == t.id:
                yield where, "a tensor cannot be a view of itself"
            elif t.view_of in px.tensor_at:
                root = tensors[px.tensor_at[t.view_of]]
                if root.view_of is not None:
                    yield (
                        where,
                        f"names view {root.id!r}; view_of must name the root {root.view_of!r}",
                    )
            elif not px.is_external(t.view_of):
                yield where, f"names unknown tensor {t.view_of!r}"
            if t.kind == "state":
                binding = px.inputs.get(t.view_of)
                if binding is None or binding.kind != "state":
                    yield where, "a state tensor must alias the state input binding it updates"
            producer = px.producer.get(t.id)
            if producer is not None and not _reads_root(
                px, px.phase.ops[producer].inputs, t.view_of
            ):
                yield (
                    where,
                    f"op {producer} makes this view but reads neither {t.view_of!r} nor a view of it",
                )
            if t.buffer is not None or t.offset is not None:
                yield (
                    px.tensor_path(i),
                    "a view owns no bytes: it must have no buffer and no offset",
                )


def _reads_root(px: PhaseIndex, inputs: list[str], root: str) -> bool:
    """Whether an op with ``inputs`` reads ``root`` directly or through one of its views."""
    tensors = px.phase.tensors
    for tensor_id in inputs:
        if tensor_id == root:
            return True
        position = px.tensor_at.get(tensor_id)
        if position is not None and tensors[position].view_of == root:
            return True
    return False


def arena_overlap(ix: PlanIndex) -> Iterator[Finding]:
    """Tenants live at the same time never share arena bytes.

    Sweep over time: tenants enter in order of their first slot and leave (heap by last slot) once
    dead; the live ones are kept sorted by offset, so a newcomer ``[lo, hi)`` is only compared with
    live tenants starting in ``(lo - widest, hi)`` -- anything starting lower ends before ``lo``.
    Every overlapping pair is reported once, at the tenant that starts later.
    """
    for px in ix.phases:
        placed = [(i, t) for i, t in _tenants(px) if t.offset is not None and t.bytes > 0]
        placed.sort(key=lambda item: (item[1].interval[0], item[1].interval[1], item[1].offset))
        widest = max((t.bytes for _, t in placed), default=0)
        by_offset: list[tuple[int, int]] = []  # (offset, seq) of live tenants, sorted
        live: dict[int, tuple[int, Tensor]] = {}  # seq -> (position, tensor)
        expiry: list[tuple[int, int]] = []  # heap of (last slot, seq)
        for seq, (i, t) in enumerate(placed):
            start = t.interval[0]
            while expiry and expiry[0][0] < start:
                _, gone = heapq.heappop(expiry)
                del by_offset[bisect.bisect_left(by_offset, (live.pop(gone)[1].offset, gone))]
            lo, hi = t.offset, t.offset + t.bytes
            k = bisect.bisect_left(by_offset, (hi, -1)) - 1  # last live tenant starting below hi
            while k >= 0 and by_offset[k][0] > lo - widest:
                a = live[by_offset[k][1]][1]
                if a.offset + a.bytes > lo:
                    both = f"{max(start, a.interval[0])}..{min(t.interval[1], a.interval[1])}"
                    yield (
                        px.tensor_path(i),
                        f"bytes [{lo}, {hi}) overlap tensor {a.id!r} [{a.offset}, {a.offset + a.bytes}) "
                        f"while both are live (slots {both})",
                    )
                k -= 1
            bisect.insort(by_offset, (t.offset, seq))
            live[seq] = (i, t)
            heapq.heappush(expiry, (t.interval[1], seq))


def buffer_overlap(ix: PlanIndex) -> Iterator[Finding]:
    """Tenants of one colouring buffer are never live at the same time."""
    for px in ix.phases:
        by_buffer: dict[int, list[tuple[int, Tensor]]] = {}
        for i, t in _tenants(px):
            if t.buffer is not None:
                by_buffer.setdefault(t.buffer, []).append((i, t))
        for buffer_id, tenants in by_buffer.items():
            tenants.sort(key=lambda item: item[1].interval)
            latest: Tensor | None = None  # the tenant live longest so far
            for i, t in tenants:
                if latest is not None and t.interval[0] <= latest.interval[1]:
                    yield (
                        f"{px.tensor_path(i)}.buffer",
                        f"shares buffer {buffer_id} with {latest.id!r} while both are live "
                        f"({t.interval} and {latest.interval})",
                    )
                if latest is None or t.interval[1] > latest.interval[1]:
                    latest = t


def buffer_holds_tenants(ix: PlanIndex) -> Iterator[Finding]:
    """Every tenant has an existing buffer large enough and an aligned offset; state has neither."""
    alignment = _alignment(ix)
    for px in ix.phases:
        buffers = {b.id: b for b in px.phase.buffers}
        for i, t in enumerate(px.phase.tensors):
            path = px.tensor_path(i)
            if t.view_of is not None:
                continue  # view_root owns views
            if not is_arena_tenant(t):
                if t.buffer is not None or t.offset is not None:
                    yield path, "a state tensor aliases persistent state: no buffer or offset"
                continue
            if t.buffer is None:
                yield f"{path}.buffer", "arena tensor has no buffer"
            elif t.buffer not in buffers:
                yield f"{path}.buffer", f"buffer {t.buffer} does not exist"
            elif t.bytes > buffers[t.buffer].bytes:
                yield (
                    f"{path}.buffer",
                    f"{t.bytes} bytes do not fit buffer {t.buffer} ({buffers[t.buffer].bytes} bytes)",
                )
            if t.offset is None:
                yield f"{path}.offset", "arena tensor has no offset"
            elif t.offset % alignment:
                yield (
                    f"{path}.offset",
                    f"offset {t.offset} is not a multiple of the alignment {alignment}",
                )


def buffer_sized(ix: PlanIndex) -> Iterator[Finding]:
    """Each buffer has tenants and is exactly as large as its largest one (the colouring's rule)."""
    for px in ix.phases:
        largest: dict[int, int] = {}
        for t in px.phase.tensors:
            if is_arena_tenant(t) and t.buffer is not None:
                largest[t.buffer] = max(largest.get(t.buffer, 0), t.bytes)
        for k, b in enumerate(px.phase.buffers):
            where = f"{px.path}.buffers[{k}].bytes"
            if b.id not in largest:
                yield f"{px.path}.buffers[{k}]", f"buffer {b.id} has no tenant"
            elif b.bytes != largest[b.id]:
                yield (
                    where,
                    f"buffer {b.id} is {b.bytes} bytes but its largest tenant is {largest[b.id]}",
                )


def arena_bounds(ix: PlanIndex) -> Iterator[Finding]:
    """The arena holds every tenant; the lower bound is recomputed exactly and is <= the arena."""
    alignment = _alignment(ix)
    for px in ix.phases:
        phase = px.phase
        for i, t in enumerate(phase.tensors):
            if is_arena_tenant(t) and t.offset is not None:
                end = align_up(t.offset + t.bytes, alignment)
                if end > phase.arena_bytes:
                    yield (
                        f"{px.tensor_path(i)}.offset",
                        f"ends at byte {end} (aligned), beyond arena_bytes {phase.arena_bytes}",
                    )
        bound = lower_bound_bytes(phase.tensors, px.num_slots, alignment)
        if phase.lower_bound_bytes != bound:
            yield (
                f"{px.path}.lower_bound_bytes",
                f"{phase.lower_bound_bytes}, but the most aligned bytes live in one slot is {bound}",
            )
        if phase.lower_bound_bytes > phase.arena_bytes:
            yield (
                f"{px.path}.lower_bound_bytes",
                f"lower bound {phase.lower_bound_bytes} exceeds arena_bytes {phase.arena_bytes}",
            )
        target = ix.plan.target
        slack = slack_bytes(
            phase.tensors, px.num_slots, target.allocator_slack, target.memory_model
        )
        if phase.slack_bytes != slack:
            model = target.memory_model
            how = "cache reuse"
            if model is not None:
                how = f"the {model.name} allocator's rounding and cache reuse"
            yield (
                f"{px.path}.slack_bytes",
                f"{phase.slack_bytes}, but {how} can add up to {slack} bytes to the live tenants",
            )


def arena_claim(ix: PlanIndex) -> Iterator[Finding]:
    """What a phase claims about its arena's optimality agrees with its bytes.

    "lower_bound" needs arena == lower bound; a proven arena has no gap; an unproven one has a gap
    of at least 1 byte and at most arena - lower bound (its proven bound on the optimum is never
    below the live-bytes bound), so an arena that reaches the lower bound must claim it. A
    "search" proof above the lower bound cannot be re-checked here (deciding it is NP-hard: it
    takes the exhaustive search again); `dctms pack` on the phase's tenants repeats it.
    """
    for px in ix.phases:
        phase = px.phase
        arena, lower, gap = phase.arena_bytes, phase.lower_bound_bytes, phase.arena_gap_bytes
        if phase.arena_optimal == "lower_bound" and arena != lower:
            yield (
                f"{px.path}.arena_optimal",
                f'claims "lower_bound" but arena_bytes {arena} != lower_bound_bytes {lower}',
            )
        if phase.arena_optimal is not None and gap:
            yield (
                f"{px.path}.arena_gap_bytes",
                f"{gap}, but an arena proven optimal ({phase.arena_optimal!r}) has no gap",
            )
        if phase.arena_optimal is None:
            if arena == lower:
                yield (
                    f"{px.path}.arena_optimal",
                    f'arena_bytes equals lower_bound_bytes ({lower}): the claim must be "lower_bound"',
                )
            elif not 0 < gap <= arena - lower:
                yield (
                    f"{px.path}.arena_gap_bytes",
                    f"{gap}, but an unproven arena's gap is between 1 and arena - lower bound "
                    f"({arena - lower})",
                )
