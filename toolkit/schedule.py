"""Pass 2, schedule: execution order, segments between sync points, and concurrent slots.

* Order: the order MLX really runs the graph in (``order.mlx_eval_order``), per segment.
* Sync points: the host evaluates at the end of the phase (the next token goes to the host) and,
  with ``sync_every=N``, after every N decoder layers (a segment boundary drains MLX's run-ahead). Each sync point lists the tensors ``mx.eval`` receives, in
  order: those made in the segment and read later, and the phase outputs made in it.
* Slots: consecutive ops of a segment are grouped while they are independent (an antichain of the
  DAG) and hold at most one memory-bound op (roofline: intensity below the ridge point).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dctms.schema.aliasing import IN_PLACE
from dctms.schema.sizes import ITEMSIZE
from dctms.toolkit.order import mlx_eval_order, producers
from dctms.toolkit.trace import TracedPhase

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Segment:
    ops: list[int]  # traced op indices in execution order
    evaluate: list[str]  # tensors passed to mx.eval at the segment's sync point
    reason: str


@dataclass(frozen=True)
class Schedule:
    order: list[int]  # traced op indices in execution order (all segments)
    slots: list[list[int]]  # execution positions per slot
    segments: list[Segment]
    sync_slots: list[int]  # last slot of each segment
    layers: list[int | None]  # per traced op
    memory_bound: list[bool]  # per traced op


def op_layers(phase: TracedPhase) -> list[int | None]:
    """Decoder layer of each op: from the layer weights it reads, else inherited from its inputs."""
    weight_layer: dict[str, int | None] = {}
    for b in phase.inputs:
        if b.kind == "weight":
            m = _LAYER.search(b.name)
            weight_layer[b.id] = int(m.group(1)) if m else None
        elif b.kind == "state":
            weight_layer[b.id] = int(b.name.split(".")[1])
    tensor_layer: dict[str, int | None] = {}
    layers: list[int | None] = []
    for op in phase.ops:
        direct = [weight_layer[t] for t in op.inputs if t in weight_layer]
        if any(layer is not None for layer in direct):
            layer = max(x for x in direct if x is not None)
        elif direct:
            layer = None  # reads a model-level weight (embedding, final norm, head)
        else:
            inherited = [tensor_layer[t] for t in op.inputs if tensor_layer.get(t) is not None]
            layer = max(inherited) if inherited else None
        layers.append(layer)
        for t in op.outputs:
            tensor_layer[t] = layer
    return layers


def _data_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def op_flops(primitive: str, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...]) -> float:
    """Rough FLOP count, enough to place an op on the roofline."""
    size = math.prod(out_shape)
    if primitive in ("Matmul", "AddMM", "QuantizedMatmul", "GatherMM", "GatherQMM"):
        k = in_shapes[0][-1] if in_shapes and in_shapes[0] else 1
        return 2.0 * size * k
    if primitive in ("Softmax", "LogSumExp"):
        return 5.0 * math.prod(in_shapes[0])
    if primitive in ("Reduce", "ArgReduce"):
        return float(math.prod(in_shapes[0]))
    return float(size)


def memory_bound_flags(phase: TracedPhase, views: set[int], ridge: float) -> list[bool]:
    flags = []
    for i, op in enumerate(phase.ops):
        if i in views:
            flags.append(False)  # a view moves no bytes
            continue
        ins = [phase.tensors[t] for t in op.inputs]
        outs = [phase.tensors[t] for t in op.outputs]
        moved = sum(_data_bytes(t.shape, t.dtype) for t in ins + outs)
        flops = op_flops(op.primitive, [t.shape for t in ins], outs[0].shape)
        flags.append(moved > 0 and flops / moved < ridge)
    return flags


def donation_cuts(
    phase: TracedPhase, global_order: list[int], position: dict[int, int]
) -> dict[int, str]:
    """Sync points (positions in ``global_order``, with their reason) that let an in-place write
    of a state array find its buffer free: after the last op that reads the array before it.

    MLX decides whether an update may reuse (donate) its input's buffer when it schedules the
    update, and a reader still queued holds that buffer: the update then copies the whole array
    instead (measured: a slot move of every KV row without the sync copied all of the KV). A read
    that completes at a sync point before the update leaves the buffer to it. Only a phase that
    reads a state array before writing it gets these (``toolkit.slot_move``'s rows)."""
    state = {b.id: b.name for b in phase.inputs if b.kind == "state"}
    readers: dict[str, list[int]] = {}
    for i in global_order:
        for t in phase.ops[i].inputs:
            if t in state:
                readers.setdefault(t, []).append(i)
    cuts: dict[int, str] = {}
    for i in global_order:
        op = phase.ops[i]
        if op.primitive not in IN_PLACE or not op.inputs or op.inputs[0] not in state:
            continue
        before = [position[j] for j in readers[op.inputs[0]] if position[j] < position[i]]
        if before:
            cuts[max(before)] = f"{state[op.inputs[0]]} read before its in-place update"
    return cuts


def build_schedule(
    phase: TracedPhase, views: set[int], ridge: float, sync_every: int = 0
) -> Schedule:
    """``sync_every``: decoder layers per segment (0: one segment, synced at the phase end only)."""
    ops = phase.ops
    op_inputs = [op.inputs for op in ops]
    op_outputs = [op.outputs for op in ops]
    outputs = [b.id for b in phase.outputs]
    layers = op_layers(phase)
    mem_bound = memory_bound_flags(phase, views, ridge)

    producer = producers(op_outputs)
    global_order = mlx_eval_order(op_inputs, op_outputs, outputs, producer=producer)
    # Cut after the last op of each decoder layer (in execution order) and at the end.
    last_pos: dict[int, int] = {}
    for pos, i in enumerate(global_order):
        if layers[i] is not None:
            last_pos[layers[i]] = pos
    if sync_every > 0:
        last_pos = {
            layer: p
            for layer, p in last_pos.items()
            if (layer + 1) % sync_every == 0 or layer == max(last_pos)
        }
    else:
        last_pos = {}
    position = {i: p for p, i in enumerate(global_order)}
    donation = donation_cuts(phase, global_order, position)
    cuts = sorted({p for p in last_pos.values()} | set(donation) | {len(global_order) - 1})
    reasons = {p: f"end of layer {layer}" for layer, p in last_pos.items()}
    reasons |= {p: why for p, why in donation.items() if p not in reasons}
    reasons[len(global_order) - 1] = "phase end: next token and cache to the host"

    last_reader: dict[str, int] = {}
    for i in global_order:
        for t in op_inputs[i]:
            last_reader[t] = max(last_reader.get(t, -1), position[i])
    phase_outputs = set(outputs)

    segments: list[Segment] = []
    done: set[int] = set()
    start = 0
    for cut in cuts:
        seg_list = global_order[start : cut + 1]
        seg_ops = set(seg_list)
        made = [
            t
            for i in seg_list
            for t in op_outputs[i]
            if t in phase_outputs or last_reader.get(t, -1) > cut
        ]
        seg_order = mlx_eval_order(op_inputs, op_outputs, made, done=done, producer=producer)
        if set(seg_order) != seg_ops:  # every op in a segment feeds something evaluated
            raise AssertionError("segment evaluation does not cover its ops")
        segments.append(Segment(seg_order, made, reasons[cut]))
        done |= seg_ops
        start = cut + 1

    order = [i for s in segments for i in s.ops]
    slots: list[list[int]] = []
    sync_slots: list[int] = []
    pos_of = {i: p for p, i in enumerate(order)}
    for seg in segments:
        current: list[int] = []
        current_outputs: set[str] = set()
        has_bound = False
        for i in seg.ops:
            depends = any(t in current_outputs for t in op_inputs[i])
            if current and (depends or (mem_bound[i] and has_bound)):
                slots.append(current)
                current, current_outputs, has_bound = [], set(), False
            current.append(pos_of[i])
            current_outputs.update(op_outputs[i])
            has_bound = has_bound or mem_bound[i]
        if current:
            slots.append(current)
        sync_slots.append(len(slots) - 1)
    return Schedule(order, slots, segments, sync_slots, layers, mem_bound)
