"""The verifier against generated plans: valid ones pass, its sweeps agree with brute force, and a
7B-sized phase (~6,000 tensors) is verified quickly.

``build_plan`` is a deliberately naive planner (ASAP slots, first-fit colouring and offsets) written
only for these tests; it shares nothing with the compiler in ``toolkit``. Its plans follow the plan
conventions: optional scratch tenants ``scratch.N``, intervals widened past the last read by up to
``OpSpec.widen`` slots but never past the next sync point, sync points that evaluate what crosses
them and the phase outputs, and at most one KV-cache update whose "state" tensor aliases ``k_in``
(then the only op that reads ``k_in``: rule ``state_in_place``).
"""

from __future__ import annotations

import bisect
import itertools
import random
import time
from dataclasses import dataclass

import pytest
from conftest import make_tiny_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from dctms.schema.io import decode_plan, encode_plan
from dctms.schema.phase_index import build_plan_index
from dctms.schema.sizes import align_up, is_arena_tenant, lower_bound_bytes, nbytes
from dctms.schema.types import (
    Binding,
    Buffer,
    Intermediate,
    Op,
    Output,
    Phase,
    Plan,
    Scratch,
    StateView,
    Stats,
    SyncPoint,
    Tensor,
)
from dctms.schema.verify import MAX_PER_RULE, RULES, verify_plan

EXTERNAL = ("tok", "w_emb", "k_in")  # the tiny plan's input binding, weight and KV cache
STATE_IN = "k_in"  # the state input binding a "state" op updates (the tiny plan's layers.0.keys)


@dataclass
class OpSpec:
    inputs: list[str]
    shape: list[int]
    dtype: str = "float16"
    view: bool = False  # the output aliases its first input's root
    memory_bound: bool = False
    scratch: int = 0  # scratch bytes: the op gets a tenant "scratch.<i>"
    widen: int = 0  # slots its tensors are kept past their last read (capped at the next sync)
    sync: bool = False  # a sync point after this op's slot
    state: bool = False  # updates the KV cache in place: a "state" tensor, view of STATE_IN


def build_plan(specs: list[OpSpec], outputs: set[int], alignment: int = 64) -> Plan:
    """A valid single-phase plan for ops ``specs`` (op i writes tensor "x{i}").

    At most one spec has ``state`` (one output binding per state name); it must read ``STATE_IN``
    and must not be in ``outputs``.
    """
    base = make_tiny_plan()
    ids = [f"x{i}" for i in range(len(specs))]
    producer = {tid: i for i, tid in enumerate(ids)}
    state_ops = [i for i, spec in enumerate(specs) if spec.state]
    assert len(state_ops) <= 1 and not set(state_ops) & outputs
    assert all(STATE_IN in specs[i].inputs and not specs[i].view for i in state_ops)
    state_in = next(b for b in base.phases[0].inputs if b.id == STATE_IN)

    # Slots: as soon as the inputs are ready, one memory-bound op per slot, empty slots squeezed out.
    slot: list[int] = []
    bound_slots: set[int] = set()
    for spec in specs:
        s = 1 + max((slot[producer[x]] for x in spec.inputs if x in producer), default=-1)
        while spec.memory_bound and s in bound_slots:
            s += 1
        if spec.memory_bound:
            bound_slots.add(s)
        slot.append(s)
    renumber = {s: k for k, s in enumerate(sorted(set(slot)))}
    slot = [renumber[s] for s in slot]
    last = max(slot)
    syncs = sorted({slot[i] for i, spec in enumerate(specs) if spec.sync} | {last})

    def kept(read: int, widen: int) -> int:
        """Last slot of a tensor last read in ``read``: widened, not past the next sync point."""
        return min(read + widen, syncs[bisect.bisect_left(syncs, read)])

    # Views name the root (a state tensor's root is STATE_IN); intervals run to the last reader or
    # a view's end, widened up to the next sync point, and phase outputs to the phase end.
    root: dict[str, str | None] = {}
    for i, spec in enumerate(specs):
        source = spec.inputs[0]
        if spec.state:
            root[ids[i]] = STATE_IN
        else:
            root[ids[i]] = (root.get(source) or source) if spec.view else None
    end = {tid: slot[i] for i, tid in enumerate(ids)}
    for i, spec in enumerate(specs):
        for x in spec.inputs:
            if x in end:
                end[x] = max(end[x], slot[i])
    for i in outputs:
        end[ids[i]] = last
    for i in reversed(range(len(ids))):  # views come after their roots
        tid = ids[i]
        if i not in outputs and not specs[i].state:
            end[tid] = kept(end[tid], specs[i].widen)
        if root[tid] in end:
            end[root[tid]] = max(end[root[tid]], end[tid])

    tensors: list[Tensor] = []
    for i, tid in enumerate(ids):
        spec = specs[i]
        if spec.state:
            tensors.append(
                StateView(
                    tid,
                    state_in.shape,
                    state_in.dtype,
                    nbytes(state_in.shape, state_in.dtype),
                    [slot[i], end[tid]],
                    view_of=STATE_IN,
                )
            )
        else:
            tensors.append(
                (Output if i in outputs else Intermediate)(
                    tid,
                    spec.shape,
                    spec.dtype,
                    nbytes(spec.shape, spec.dtype),
                    [slot[i], end[tid]],
                    view_of=root[tid],
                )
            )
        if spec.scratch:
            interval = [slot[i], kept(slot[i], spec.widen)]
            tensors.append(
                Scratch(f"scratch.{i}", [spec.scratch], "uint8", spec.scratch, interval, op=i)
            )
    tensors = _assign(tensors, alignment)
    buffers = _buffers(tensors)
    arena = max(
        (align_up(t.offset + t.bytes, alignment) for t in tensors if t.offset is not None),
        default=0,
    )
    bound = lower_bound_bytes(tensors, last + 1, alignment)
    phase = Phase(
        name="decode",
        tokens=1,
        inputs=[b for b in base.phases[0].inputs if b.id in EXTERNAL],
        outputs=[
            Binding(ids[i], "output", f"out{i}", specs[i].shape, specs[i].dtype)
            for i in sorted(outputs)
        ]
        + [replace(state_in, id=ids[i]) for i in state_ops],
        constants=[],
        ops=[
            Op(
                _primitive(s),
                s.inputs,
                [ids[i]],
                memory_bound=s.memory_bound,
                scratch=s.scratch,
            )
            for i, s in enumerate(specs)
        ],
        tensors=tensors,
        buffers=buffers,
        slots=[[i for i in range(len(specs)) if slot[i] == k] for k in range(last + 1)],
        sync_points=_sync_points(specs, ids, slot, syncs, outputs | set(state_ops)),
        arena_bytes=arena,
        lower_bound_bytes=bound,
        # This generator's own packing proves nothing beyond the lower bound.
        arena_optimal="lower_bound" if arena == bound else None,
        arena_gap_bytes=arena - bound,
    )
    env = base.envelope
    total = env.weights + env.kv + env.persistent + arena + env.runtime
    logical = sum(1 for t in tensors if is_arena_tenant(t))
    return replace(
        base,
        phases=[phase],
        envelope=replace(env, intermediate=arena, total=total, free=env.device - total),
        stats=Stats(
            logical, len(buffers), 1 - len(buffers) / logical if logical else 0.0, arena, bound
        ),
    )


def _primitive(spec: OpSpec) -> str:
    return "SliceUpdate" if spec.state else "Reshape" if spec.view else "Add"


def _sync_points(
    specs: list[OpSpec], ids: list[str], slot: list[int], syncs: list[int], bound: set[int]
) -> list[SyncPoint]:
    """Each sync point evaluates, in op order, what was made since the previous one and is either
    read after it or bound as a phase output (``bound``: op positions)."""
    last_read = {tid: -1 for tid in ids}
    for i, spec in enumerate(specs):
        for x in spec.inputs:
            if x in last_read:
                last_read[x] = max(last_read[x], slot[i])
    points, previous = [], -1
    for k, sync in enumerate(syncs):
        evaluate = [
            tid
            for i, tid in enumerate(ids)
            if previous < slot[i] <= sync and (i in bound or last_read[tid] > sync)
        ]
        reason = "phase end" if k == len(syncs) - 1 else f"segment {k}"
        points.append(SyncPoint(sync, reason, evaluate=evaluate))
        previous = sync
    return points


def _assign(tensors: list[Tensor], alignment: int) -> list[Tensor]:
    """First-fit colouring and first-fit aligned offsets, both in order of first use."""
    order = sorted(
        (i for i, t in enumerate(tensors) if is_arena_tenant(t)), key=lambda i: tensors[i].interval
    )
    colour_end: list[int] = []  # last slot of each buffer's latest tenant
    placed: list[Tensor] = []
    out = list(tensors)
    for i in order:
        t = tensors[i]
        s, e = t.interval
        colour = next((c for c, last in enumerate(colour_end) if last < s), len(colour_end))
        if colour == len(colour_end):
            colour_end.append(e)
        colour_end[colour] = e
        live = [p for p in placed if p.interval[1] >= s and p.bytes]
        offset = 0
        for candidate in sorted({0} | {align_up(p.offset + p.bytes, alignment) for p in live}):
            if all(
                candidate + t.bytes <= p.offset or p.offset + p.bytes <= candidate for p in live
            ):
                offset = candidate
                break
        out[i] = replace(t, buffer=colour, offset=offset)
        placed.append(out[i])
    return out


def _buffers(tensors: list[Tensor]) -> list[Buffer]:
    size: dict[int, int] = {}
    for t in tensors:
        if t.buffer is not None:
            size[t.buffer] = max(size.get(t.buffer, 0), t.bytes)
    return [Buffer(b, size[b]) for b in sorted(size)]


# ------------------------------------------------------------------------------------- strategies


@st.composite
def op_graphs(draw, max_ops: int = 25) -> tuple[list[OpSpec], set[int]]:
    n = draw(st.integers(1, max_ops))
    # At most one KV-cache update, never the last op (which is always a phase output).
    state_at = draw(st.none() | st.integers(0, n - 2)) if n > 1 else None
    specs: list[OpSpec] = []
    for i in range(n):
        # an update in place is the only reader of the state it writes (rule state_in_place)
        external = [e for e in EXTERNAL if e != STATE_IN or state_at in (None, i)]
        available = external + [f"x{j}" for j in range(i)]
        inputs = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3, unique=True))
        if i == state_at and STATE_IN not in inputs:
            inputs = [STATE_IN, *inputs[:2]]
        specs.append(
            OpSpec(
                inputs=inputs,
                shape=draw(st.lists(st.integers(0, 9), max_size=3)),
                dtype=draw(st.sampled_from(["float16", "float32", "uint8", "bool"])),
                view=i != state_at and draw(st.booleans()) and draw(st.booleans()),
                memory_bound=draw(st.booleans()),
                scratch=draw(st.sampled_from([0, 0, 0, 1, 8, 100])),
                widen=draw(st.sampled_from([0, 0, 1, 2, 30])),
                sync=draw(st.integers(0, 3)) == 0,
                state=i == state_at,
            )
        )
    outputs = {n - 1} | (set(draw(st.lists(st.integers(0, n - 1), max_size=2))) - {state_at})
    return specs, outputs


GENERATED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@GENERATED
@given(graph=op_graphs())
def test_generated_valid_plans_pass(graph) -> None:
    plan = build_plan(*graph)
    assert verify_plan(plan) == []
    assert encode_plan(decode_plan(encode_plan(plan))) == encode_plan(plan)  # schema agrees too


def test_generator_follows_the_new_conventions() -> None:
    """A hand-checked example: scratch tenant, run-ahead widening capped at a sync point, a state
    tensor aliasing its input, and what each sync point evaluates."""
    specs = [
        OpSpec(["w_emb", "tok"], [8], scratch=8, widen=30),  # x0, slot 0
        OpSpec(["x0"], [8], sync=True),  # x1, slot 1; sync point after slot 1
        OpSpec([STATE_IN, "x1"], [], state=True),  # x2, slot 2: the KV cache update
        OpSpec(["x1"], [8], widen=1),  # x3, slot 2
        OpSpec(["x3"], [8]),  # x4, slot 3
        OpSpec(["x4"], [8]),  # x5, slot 4: the phase output
    ]
    plan = build_plan(specs, outputs={5})
    phase = plan.phases[0]
    by_id = {t.id: t for t in phase.tensors}
    assert phase.slots == [[0], [1], [2, 3], [4], [5]]
    assert by_id["x0"].interval == [0, 1]  # last read in slot 1, which is a sync point
    assert by_id["scratch.0"].interval == [0, 1]  # never read; widened up to that sync point
    assert by_id["x3"].interval == [2, 4]  # last read in slot 3, kept one more slot
    assert (by_id["x2"].kind, by_id["x2"].view_of, by_id["x2"].buffer) == ("state", "k_in", None)
    assert [(sp.slot, sp.evaluate) for sp in phase.sync_points] == [(1, ["x1"]), (4, ["x2", "x5"])]
    assert plan.stats.logical_tensors == 6  # x0, x1, x3, x4, x5 and scratch.0
    assert verify_plan(plan) == []
    for tid, interval in [("x0", [0, 2]), ("scratch.0", [0, 2]), ("x3", [2, 2])]:
        broken = replace(
            plan,
            phases=[
                replace(
                    phase,
                    tensors=[
                        replace(t, interval=interval) if t.id == tid else t for t in phase.tensors
                    ],
                )
            ],
        )
        assert "interval_last_use" in {p.rule for p in verify_plan(broken)}, tid


def _brute_force_last_use(phase: Phase) -> set[int]:
    """Positions of tensors whose interval end breaks the rule, straight from its definition."""
    slot_of = {i: k for k, members in enumerate(phase.slots) for i in members}
    syncs = [sp.slot for sp in phase.sync_points]
    outputs = {b.id for b in phase.outputs if b.kind == "output"}
    last = len(phase.slots) - 1
    bad = set()
    for pos, t in enumerate(phase.tensors):
        if t.kind == "state":
            continue
        start, end = t.interval
        if t.kind == "output" or t.id in outputs:
            if end != last:
                bad.add(pos)
            continue
        read = max(
            [start]
            + [slot_of[i] for i, o in enumerate(phase.ops) if t.id in o.inputs]
            + [v.interval[1] for v in phase.tensors if v.view_of == t.id]
        )
        if not read <= end <= min(k for k in syncs if k >= read):
            bad.add(pos)
    return bad


@pytest.mark.slow
@GENERATED
@given(graph=op_graphs(), seed=st.integers(0, 2**32 - 1))
def test_last_use_rule_matches_brute_force(graph, seed: int) -> None:
    plan = build_plan(*graph)
    phase = plan.phases[0]
    rng = random.Random(seed)
    last = len(phase.slots) - 1
    moved = [
        replace(t, interval=[t.interval[0], rng.randint(t.interval[0], last)])
        if rng.random() < 0.3
        else t
        for t in phase.tensors
    ]
    broken = replace(phase, tensors=moved)
    reported = [
        p.path for p in verify_plan(replace(plan, phases=[broken])) if p.rule == "interval_last_use"
    ]
    expected = _brute_force_last_use(broken)
    assert len(expected) <= MAX_PER_RULE
    assert reported == [f"$.phases[0].tensors[{pos}].interval" for pos in sorted(expected)]


@pytest.mark.slow
@GENERATED
@given(graph=op_graphs(), seed=st.integers(0, 2**32 - 1))
def test_sync_evaluate_rule_matches_brute_force(graph, seed: int) -> None:
    plan = build_plan(*graph)
    phase = plan.phases[0]
    rng = random.Random(seed)
    slot_of = {i: k for k, members in enumerate(phase.slots) for i in members}
    made = {tid: slot_of[i] for i, o in enumerate(phase.ops) for tid in o.outputs}
    syncs = [sp.slot for sp in phase.sync_points]
    # Every op output is evaluated at a random sync point, or (sometimes) at none.
    evaluate: list[list[str]] = [[] for _ in syncs]
    for tid in made:
        k = rng.randrange(len(syncs) + 1)
        if k < len(syncs):
            evaluate[k].append(tid)
    points = [replace(sp, evaluate=e) for sp, e in zip(phase.sync_points, evaluate, strict=True)]
    broken = replace(plan, phases=[replace(phase, sync_points=points)])
    reported = [p for p in verify_plan(broken) if p.rule == "sync_points"]
    misplaced = sum(
        1
        for k, e in enumerate(evaluate)
        for tid in e
        if not (syncs[k - 1] if k else -1) < made[tid] <= syncs[k]
    )
    never = sum(1 for b in phase.outputs if not any(b.id in e for e in evaluate))
    readers = {}
    for i, o in enumerate(phase.ops):
        for tid in o.inputs:
            readers.setdefault(tid, []).append(slot_of[i])
    closing = {tid: min(x for x in syncs if x >= slot) for tid, slot in made.items()}
    not_evaluated = sum(
        1
        for tid, slot in made.items()
        if any(r > closing[tid] for r in readers.get(tid, []))
        and tid not in evaluate[syncs.index(closing[tid])]
    )
    assert len(reported) == misplaced + never + not_evaluated


def _brute_force_overlaps(tensors: list[Tensor]) -> int:
    tenants = [t for t in tensors if is_arena_tenant(t) and t.offset is not None and t.bytes]
    return sum(
        1
        for a, b in itertools.combinations(tenants, 2)
        if a.interval[0] <= b.interval[1]
        and b.interval[0] <= a.interval[1]
        and a.offset < b.offset + b.bytes
        and b.offset < a.offset + a.bytes
    )


def _brute_force_lower_bound(tensors: list[Tensor], slots: int, alignment: int) -> int:
    return max(
        (
            sum(
                align_up(t.bytes, alignment)
                for t in tensors
                if is_arena_tenant(t) and t.interval[0] <= k <= t.interval[1]
            )
            for k in range(slots)
        ),
        default=0,
    )


@pytest.mark.slow
@GENERATED
@given(graph=op_graphs(), seed=st.integers(0, 2**32 - 1))
def test_overlap_sweep_matches_brute_force(graph, seed: int) -> None:
    plan = build_plan(*graph)
    phase = plan.phases[0]
    rng = random.Random(seed)
    shuffled = [
        replace(t, offset=64 * rng.randrange(4)) if is_arena_tenant(t) else t for t in phase.tensors
    ]
    broken = replace(plan, phases=[replace(phase, tensors=shuffled)])
    reported = [p for p in verify_plan(broken) if p.rule == "arena_overlap"]
    expected = _brute_force_overlaps(shuffled)
    assert (
        len(reported) == min(expected, MAX_PER_RULE + 1)
        if expected > MAX_PER_RULE
        else len(reported) == expected
    )
    assert lower_bound_bytes(shuffled, len(phase.slots), 64) == _brute_force_lower_bound(
        shuffled, len(phase.slots), 64
    )


@pytest.mark.slow
@GENERATED
@given(graph=op_graphs(), seed=st.integers(0, 2**32 - 1))
def test_buffer_sweep_matches_brute_force(graph, seed: int) -> None:
    plan = build_plan(*graph)
    phase = plan.phases[0]
    rng = random.Random(seed)
    shuffled = [
        replace(t, buffer=rng.randrange(3)) if is_arena_tenant(t) else t for t in phase.tensors
    ]
    broken = replace(plan, phases=[replace(phase, tensors=shuffled)])
    reported = any(p.rule == "buffer_overlap" for p in verify_plan(broken))
    tenants = [t for t in shuffled if is_arena_tenant(t)]
    expected = any(
        a.buffer == b.buffer and a.interval[0] <= b.interval[1] and b.interval[0] <= a.interval[1]
        for a, b in itertools.combinations(tenants, 2)
    )
    assert reported == expected


# --------------------------------------------------------------------------------------- scale


def transformer_like(layers: int, ops_per_layer: int) -> list[OpSpec]:
    """A residual stream with per-layer chains, views and long-lived values (like a decoder): a sync
    point after every layer, scratch on some ops, lifetimes widened by run-ahead, and one KV-cache
    update in the first layer."""
    specs: list[OpSpec] = [OpSpec(["w_emb", "tok"], [1, 1, 3584], memory_bound=True)]
    for layer in range(layers):
        residual = prev = f"x{len(specs) - 1}"
        for k in range(ops_per_layer):
            if k % 7 == 3:
                spec = OpSpec([prev], [1, 28, 128], view=True)
            elif k % 5 == 0:
                spec = OpSpec([prev, "w_emb"], [1, 1, 18944 if k % 2 else 3584], memory_bound=True)
            else:
                spec = OpSpec([prev], [1, 1, 3584], dtype="float32" if k % 3 else "float16")
            spec.scratch = 4 * 3584 if k % 11 == 4 else 0
            spec.widen = 3 if k % 13 == 6 else 0
            specs.append(spec)
            prev = f"x{len(specs) - 1}"
            if layer == 0 and k == 1:  # writes the cache from a layer value; the chain goes on
                specs.append(OpSpec([STATE_IN, prev], [], state=True))
        specs.append(OpSpec([prev, residual], [1, 1, 3584], sync=True))
    return specs


@pytest.mark.slow
def test_seven_b_sized_phase_verifies() -> None:
    """A 7B-sized phase verifies and decodes (its times are printed; bench/verify_speed.py
    measures them: speed goals live in bench/, not in unit tests)."""
    specs = transformer_like(layers=28, ops_per_layer=214)
    plan = build_plan(specs, outputs={len(specs) - 1})
    assert len(plan.phases[0].tensors) > 6000
    start = time.perf_counter()
    problems = verify_plan(plan)
    verify_s = time.perf_counter() - start
    data = encode_plan(plan)
    start = time.perf_counter()
    decode_plan(data)
    decode_s = time.perf_counter() - start
    print(
        f"\n{len(plan.phases[0].tensors)} tensors, {len(data) / 1e6:.2f} MB: verify {verify_s:.2f} s, decode {decode_s:.2f} s"
    )
    assert problems == []


def test_rule_registry_is_complete_and_index_builds(tiny_plan: Plan) -> None:
    index = build_plan_index(tiny_plan)
    for name, rule in RULES.items():
        assert list(rule(index)) == [], name


@pytest.mark.slow
def test_overlap_sweep_when_everything_is_live() -> None:
    """Worst case for a naive active-set sweep: ~5,000 tenants all live to the end, none overlapping."""
    specs = transformer_like(layers=28, ops_per_layer=214)
    plan = build_plan(specs, outputs={len(specs) - 1})
    phase = plan.phases[0]
    last, offset, tensors = len(phase.slots) - 1, 0, []
    for t in phase.tensors:
        if t.offset is not None:
            t = replace(t, interval=[t.interval[0], last], offset=offset)
            offset += align_up(t.bytes, 64)
        tensors.append(t)
    index = build_plan_index(replace(plan, phases=[replace(phase, tensors=tensors)]))
    # (how long the sweep takes is bench/verify_speed.py's: speed goals live in bench/)
    assert list(RULES["arena_overlap"](index)) == []
