"""Verifier rules about the graph and its schedule: ids, dataflow, slots, sync points."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from dctms.schema.phase_index import PhaseIndex, PlanIndex

Finding = tuple[str, str]  # (JSON path, message); the verifier adds the rule name


def unique_ids(ix: PlanIndex) -> Iterator[Finding]:
    """Names and ids are unique; op outputs <-> Tensor records."""
    plan = ix.plan
    yield from _duplicates([p.name for p in plan.phases], "$.phases[{}].name", "phase name")
    yield from _duplicates([s.name for s in plan.state], "$.state[{}].name", "state name")
    yield from _duplicates(
        [w.name for w in plan.model.weights.tensors],
        "$.model.weights.tensors[{}].name",
        "weight name",
    )
    for px in ix.phases:
        yield from _phase_ids(px)


def _phase_ids(px: PhaseIndex) -> Iterator[Finding]:
    phase, path = px.phase, px.path
    yield from _duplicates([t.id for t in phase.tensors], path + ".tensors[{}].id", "tensor id")
    yield from _duplicates(
        [b.id for b in phase.inputs], path + ".inputs[{}].id", "input binding id"
    )
    yield from _duplicates(
        [b.id for b in phase.outputs], path + ".outputs[{}].id", "output binding id"
    )
    yield from _duplicates(
        [c.id for c in phase.constants], path + ".constants[{}].id", "constant id"
    )
    yield from _duplicates([b.id for b in phase.buffers], path + ".buffers[{}].id", "buffer id")
    # One binding per name and direction: the runner feeds and collects bindings by name.
    inputs = [(b.kind, b.name) for b in phase.inputs]
    outputs = [(b.kind, b.name) for b in phase.outputs]
    yield from _duplicates(inputs, path + ".inputs[{}].name", "input binding")
    yield from _duplicates(outputs, path + ".outputs[{}].name", "output binding")
    for position, constant in enumerate(phase.constants):
        if constant.id in px.inputs:
            yield (
                f"{path}.constants[{position}].id",
                f"constant {constant.id!r} reuses an input binding id",
            )
    produced: dict[str, int] = {}
    for position, op in enumerate(phase.ops):
        for k, tensor_id in enumerate(op.outputs):
            where = f"{px.op_path(position)}.outputs[{k}]"
            if tensor_id in produced:
                yield where, f"{tensor_id!r} is already produced by op {produced[tensor_id]}"
                continue
            produced[tensor_id] = position
            if px.is_external(tensor_id):
                yield (
                    where,
                    f"{tensor_id!r} is an input binding or constant; ops cannot redefine it",
                )
            elif tensor_id not in px.tensor_at:
                yield where, f"output {tensor_id!r} has no tensor record"
    for position, tensor in enumerate(phase.tensors):
        if tensor.id not in px.producer:
            yield (
                f"{px.tensor_path(position)}.id",
                f"tensor {tensor.id!r} is not produced by any op",
            )


def _duplicates(values: list, template: str, what: str) -> Iterator[Finding]:
    first: dict = {}
    for position, value in enumerate(values):
        if value in first:
            yield (
                template.format(position),
                f"duplicate {what} {value!r} (first at [{first[value]}])",
            )
        else:
            first[value] = position


def op_inputs_defined(ix: PlanIndex) -> Iterator[Finding]:
    """Every op input is an earlier op's output, a phase input binding or a constant."""
    for px in ix.phases:
        for position, op in enumerate(px.phase.ops):
            for k, tensor_id in enumerate(op.inputs):
                if px.is_external(tensor_id):
                    continue
                producer = px.producer.get(tensor_id)
                where = f"{px.op_path(position)}.inputs[{k}]"
                if producer is None:
                    yield (
                        where,
                        f"input {tensor_id!r} is not defined (no op output, input binding or constant)",
                    )
                elif producer >= position:
                    yield (
                        where,
                        f"input {tensor_id!r} is produced by op {producer}, which is not earlier",
                    )


def outputs_defined(ix: PlanIndex) -> Iterator[Finding]:
    """Every phase output binding names a tensor some op produces."""
    for px in ix.phases:
        for k, binding in enumerate(px.phase.outputs):
            if binding.id not in px.producer:
                yield (
                    f"{px.path}.outputs[{k}].id",
                    f"output {binding.id!r} is not produced by any op",
                )


def slots_cover(ix: PlanIndex) -> Iterator[Finding]:
    """Slots hold every op exactly once, none is empty, and producers run in earlier slots."""
    for px in ix.phases:
        phase = px.phase
        seen: dict[int, int] = {}
        for slot, members in enumerate(phase.slots):
            if not members:
                yield f"{px.path}.slots[{slot}]", "empty slot"
            for k, op_index in enumerate(members):
                where = f"{px.path}.slots[{slot}][{k}]"
                if op_index not in px.op_at_index:
                    yield where, f"op {op_index} does not exist"
                elif op_index in seen:
                    yield where, f"op {op_index} is already scheduled in slot {seen[op_index]}"
                else:
                    seen[op_index] = slot
        for position, op in enumerate(phase.ops):
            if position not in px.slot_of:
                yield f"{px.op_path(position)}", f"op {position} is in no slot"
                continue
            slot = px.slot_of[position]
            for tensor_id in op.inputs:
                producer = None if px.is_external(tensor_id) else px.producer.get(tensor_id)
                if producer is None or producer not in px.slot_of:
                    continue
                if px.slot_of[producer] >= slot:
                    yield (
                        f"{px.op_path(position)}",
                        f"op {position} runs in slot {slot} but its input {tensor_id!r} is produced "
                        f"in slot {px.slot_of[producer]} (must be earlier)",
                    )


def slot_bandwidth(ix: PlanIndex) -> Iterator[Finding]:
    """At most one memory-bound op per slot (they would compete for bandwidth)."""
    for px in ix.phases:
        ops = px.phase.ops
        for slot, members in enumerate(px.phase.slots):
            bound = [
                i for i in members if i in px.op_at_index and ops[px.op_at_index[i]].memory_bound
            ]
            if len(bound) > 1:
                yield (
                    f"{px.path}.slots[{slot}]",
                    f"{len(bound)} memory-bound ops in one slot: {bound}",
                )


def sync_points(ix: PlanIndex) -> Iterator[Finding]:
    """Sync points name existing slots in increasing order, and every phase ends with one."""
    for px in ix.phases:
        slots = [sp.slot for sp in px.phase.sync_points]
        for k, slot in enumerate(slots):
            where = f"{px.path}.sync_points[{k}].slot"
            if not 0 <= slot < px.num_slots:
                yield where, f"slot {slot} does not exist (phase has {px.num_slots} slots)"
            elif k and slot <= slots[k - 1]:
                yield where, f"slot {slot} is not after the previous sync point ({slots[k - 1]})"
        last = px.num_slots - 1
        if last >= 0 and last not in slots:
            yield f"{px.path}.sync_points", f"the last slot ({last}) is not a sync point"
        yield from _sync_evaluate(px)


def _sync_evaluate(px: PhaseIndex) -> Iterator[Finding]:
    # What a sync point evaluates was made since the previous one; outputs are evaluated where made.
    previous = -1
    evaluated: set[str] = set()
    for k, sp in enumerate(px.phase.sync_points):
        for j, tensor_id in enumerate(sp.evaluate):
            where = f"{px.path}.sync_points[{k}].evaluate[{j}]"
            producer = px.producer.get(tensor_id)
            slot = px.slot_of.get(producer) if producer is not None else None
            if slot is None:
                yield where, f"{tensor_id!r} is not made by any scheduled op"
            elif not previous < slot <= sp.slot:
                yield (
                    where,
                    f"{tensor_id!r} is made in slot {slot}, not between slots {previous + 1} and {sp.slot}",
                )
            evaluated.add(tensor_id)
        previous = sp.slot
    for k, binding in enumerate(px.phase.outputs):
        if binding.id in px.producer and binding.id not in evaluated:
            yield (
                f"{px.path}.outputs[{k}].id",
                f"output {binding.id!r} is evaluated at no sync point",
            )
    yield from _crossing_evaluated(px)


def _crossing_evaluated(px: PhaseIndex) -> Iterator[Finding]:
    # A tensor read after the sync point closing its segment must be evaluated there: the runner
    # evaluates exactly the listed tensors, and anything left lazy would run in the wrong segment.
    syncs = sorted(sp.slot for sp in px.phase.sync_points)
    listed = {sp.slot: set(sp.evaluate) for sp in px.phase.sync_points}
    for position, tensor in enumerate(px.phase.tensors):
        producer = px.producer.get(tensor.id)
        slot = px.slot_of.get(producer) if producer is not None else None
        if slot is None or tensor.kind == "scratch":
            continue
        k = bisect.bisect_left(syncs, slot)
        if k == len(syncs):
            continue
        read_later = any(px.slot_of.get(c, -1) > syncs[k] for c in px.consumers.get(tensor.id, []))
        if read_later and tensor.id not in listed[syncs[k]]:
            yield (
                f"{px.tensor_path(position)}.id",
                f"{tensor.id!r} is read after the sync point at slot {syncs[k]} but not evaluated there",
            )
