"""A plan's memory as a Chrome/Perfetto trace (JSON trace event format), as plain data.

One process per phase. Each arena tenant is a complete event ("ph": "X") on the track of its physical
buffer (tenants of one buffer never overlap in time, so a track never stacks), named by the module
that made it (``model.layers.3.self_attn: ALV [1,4,7,512,2048] bfloat16``); a "modules" track holds
one slice per run of slots whose ops one module made (category "module"), so a viewer's
aggregation by name sums time per module; counters ("ph": "C") give the live bytes and the arena
extent in use per slot; sync points are instant events.

Time is schedule slots, not microseconds: the format only has microsecond timestamps, so ``ts`` is
the first slot and ``dur`` the number of slots, and a viewer's "1 us" means one slot. The trace says
so in ``otherData`` and in every process name. ``displayTimeUnit`` is left out on purpose: it only
accepts "ms" or "ns", neither of which is true here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dctms.figures.units import human
from dctms.figures.vision import stream_of
from dctms.schema.modules import op_modules, path_layer
from dctms.schema.phase_index import build_index
from dctms.schema.sizes import align_up, is_arena_tenant
from dctms.schema.types import Phase, Plan, Scratch

TIME_UNIT_NOTE = (
    "ts and dur count schedule slots (ops in one slot run together), not time: "
    "a viewer's 1 us is 1 slot"
)
LIVE_COUNTER = "live bytes (aligned)"
EXTENT_COUNTER = "arena extent (bytes)"
NO_BUFFER_TID = 0  # buffers are tracks 1..n


def trace_document(plan: Plan) -> dict[str, Any]:
    """The whole trace: ``{"traceEvents": [...], "otherData": {...}}``."""
    events: list[dict[str, Any]] = []
    for pid, phase in enumerate(plan.phases, start=1):
        events += phase_events(plan, phase, pid)
    _name_streams(plan, events)
    m, b, e = plan.model, plan.bounds, plan.envelope
    return {
        "traceEvents": events,
        "otherData": {
            "time_unit": "slot",
            "time_unit_note": TIME_UNIT_NOTE,
            "byte_unit": "bytes",
            "model": f"{m.architecture}, {m.num_layers} layers",
            "config_sha256": m.config_sha256,
            "input_tokens": b.input_tokens,
            "output_tokens": b.output_tokens,
            "alignment": plan.target.alignment,
            "m_max_bytes": e.total,
            "intermediate_bytes": e.intermediate,
        },
    }


def phase_events(plan: Plan, phase: Phase, pid: int) -> list[dict[str, Any]]:
    """Metadata, tenant, counter and sync-point events of one phase (process ``pid``)."""
    align = plan.target.alignment
    index = build_index(phase, "$")
    modules = op_modules(plan, phase)
    tenants = [t for t in phase.tensors if is_arena_tenant(t)]
    buffers = {t.buffer for t in tenants}
    events = _metadata(phase, pid, buffers)
    for t in tenants:
        s, e = t.interval
        position = t.op if isinstance(t, Scratch) else index.producer.get(t.id)
        op = None if position is None else phase.ops[position]
        module = None if position is None else modules[position]
        what = f"{t.id} [{','.join(map(str, t.shape))}] {t.dtype}"
        events.append(
            {
                "name": what if module is None else f"{module}: {what}",
                "cat": t.kind,
                "ph": "X",
                "pid": pid,
                "tid": NO_BUFFER_TID if t.buffer is None else t.buffer + 1,
                "ts": s,
                "dur": e - s + 1,  # intervals are inclusive: [s, e] covers e - s + 1 slots
                "args": {
                    "tensor": t.id,
                    "bytes": t.bytes,
                    "aligned_bytes": align_up(t.bytes, align),
                    "offset": t.offset,
                    "buffer": t.buffer,
                    "shape": t.shape,
                    "dtype": t.dtype,
                    "slots": [s, e],
                    "op": None if op is None else f"{op.primitive} #{position}",
                    "module": module,
                    "layer": path_layer(module),
                },
            }
        )
    events += _module_track(
        phase, modules, pid, max((b for b in buffers if b is not None), default=-1) + 2
    )
    events += _counters(phase, pid, align)
    for sp in phase.sync_points:
        events.append(
            {
                "name": f"sync: {sp.reason}",
                "ph": "i",
                "s": "p",
                "pid": pid,
                "tid": NO_BUFFER_TID,
                "ts": sp.slot + 1,  # the host waits after the slot
                "args": {"slot": sp.slot, "evaluates": len(sp.evaluate)},
            }
        )
    return events


def _module_track(
    phase: Phase, modules: list[str | None], pid: int, tid: int
) -> list[dict[str, Any]]:
    """One slice per run of slots whose first op one module made (none without module paths)."""
    per_slot = [modules[ops[0]] if ops else None for ops in phase.slots]
    if all(m is None for m in per_slot):
        return []
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": "modules"}},
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": -1},
        },
    ]
    start = 0
    for slot in range(1, len(per_slot) + 1):
        if slot < len(per_slot) and per_slot[slot] == per_slot[start]:
            continue
        module = per_slot[start]
        if module is not None:
            ops = sum(len(phase.slots[k]) for k in range(start, slot))
            events.append(
                {
                    "name": module,
                    "cat": "module",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": start,
                    "dur": slot - start,
                    "args": {"module": module, "slots": [start, slot - 1], "ops": ops},
                }
            )
        start = slot
    return events


def live_bytes(phase: Phase, alignment: int) -> list[int]:
    """Aligned bytes of the arena tenants live in each slot (its maximum is the lower bound)."""
    delta = [0] * (len(phase.slots) + 1)
    for t in phase.tensors:
        if is_arena_tenant(t):
            size = align_up(t.bytes, alignment)
            delta[t.interval[0]] += size
            delta[t.interval[1] + 1] -= size
    live, out = 0, []
    for change in delta[:-1]:
        live += change
        out.append(live)
    return out


def arena_extent(phase: Phase, alignment: int) -> list[int]:
    """Per slot, the highest arena byte in use (offset + aligned bytes of a live tenant)."""
    top = np.zeros(len(phase.slots), dtype=np.int64)
    for t in phase.tensors:
        if is_arena_tenant(t) and t.offset is not None:
            s, e = t.interval
            np.maximum(top[s : e + 1], t.offset + align_up(t.bytes, alignment), out=top[s : e + 1])
    return [int(x) for x in top]


def _metadata(phase: Phase, pid: int, buffers: set[int | None]) -> list[dict[str, Any]]:
    size_of = {b.id: b.bytes for b in phase.buffers}
    name = (
        f"{phase.name} phase ({phase.tokens} token{'s' if phase.tokens != 1 else ''}/call): "
        f"time axis = schedule slots ({len(phase.slots)} slots), 1 us shown = 1 slot"
    )
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        {
            "name": "thread_name",
            "ph": "M",
            "pid": pid,
            "tid": NO_BUFFER_TID,
            "args": {"name": "sync points / no buffer"},
        },
    ]
    for b in sorted(x for x in buffers if x is not None):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": b + 1,
                "args": {"name": f"buffer {b} ({human(size_of.get(b, 0))})"},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": b + 1,
                "args": {"sort_index": b + 1},
            }
        )
    return events


def _counters(phase: Phase, pid: int, alignment: int) -> list[dict[str, Any]]:
    """Counter samples where the value changes, and a closing zero after the last slot."""
    events: list[dict[str, Any]] = []
    for name, series in (
        (LIVE_COUNTER, live_bytes(phase, alignment)),
        (EXTENT_COUNTER, arena_extent(phase, alignment)),
    ):
        previous = None
        for slot, value in enumerate(series + [0]):
            if value != previous:
                events.append(
                    {"name": name, "ph": "C", "pid": pid, "ts": slot, "args": {"bytes": value}}
                )
                previous = value
    return events


def _name_streams(plan: Plan, events: list[dict[str, Any]]) -> None:
    """A vision-language plan's phases are processes named with their stream (vision, text) and
    MLX stream, so the viewer shows the streams as separate groups of tracks."""
    streams = stream_of(plan)
    names = {pid: phase.name for pid, phase in enumerate(plan.phases, start=1)}
    for ev in events:
        if ev.get("name") == "process_name" and names.get(ev["pid"]) in streams:
            stream, mlx = streams[names[ev["pid"]]]
            ev["args"]["name"] += f" [{stream} stream, MLX stream {mlx}]"
