"""The verifier against generated plans: valid ones pass, its sweeps agree with brute force, and a
7B-sized phase (~6,000 tensors) is verified quickly.

``build_plan`` is a deliberately naive planner (ASAP slots, first-fit colouring and offsets) written
only for these tests; it shares nothing with the compiler in ``toolkit``.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

from conftest import make_tiny_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from dctms.schema.io import decode_plan, encode_plan
from dctms.schema.phase_index import build_plan_index
from dctms.schema.sizes import align_up, is_arena_tenant, lower_bound_bytes, nbytes
from dctms.schema.types import Binding, Buffer, Op, Phase, Plan, Stats, SyncPoint, Tensor
from dctms.schema.verify import MAX_PER_RULE, RULES, verify_plan

EXTERNAL = ("tok", "w_emb")  # the tiny plan's input binding and weight


@dataclass
class OpSpec:
    inputs: list[str]
    shape: list[int]
    dtype: str = "float16"
    view: bool = False  # the output aliases its first input's root
    memory_bound: bool = False


def build_plan(specs: list[OpSpec], outputs: set[int], alignment: int = 64) -> Plan:
    """A valid single-phase plan for ops ``specs`` (op i writes tensor "x{i}")."""
    base = make_tiny_plan()
    ids = [f"x{i}" for i in range(len(specs))]
    producer = {tid: i for i, tid in enumerate(ids)}

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

    # Views name the root; intervals run to the last reader, a view's end, or the phase end.
    root: dict[str, str | None] = {}
    for i, spec in enumerate(specs):
        source = spec.inputs[0]
        root[ids[i]] = (root.get(source) or source) if spec.view else None
    end = {tid: slot[i] for i, tid in enumerate(ids)}
    for i, spec in enumerate(specs):
        for x in spec.inputs:
            if x in end:
                end[x] = max(end[x], slot[i])
    for i in outputs:
        end[ids[i]] = last
    for tid in reversed(ids):  # views come after their roots
        if root[tid] in end:
            end[root[tid]] = max(end[root[tid]], end[tid])

    tensors = [
        Tensor(
            tid,
            specs[i].shape,
            specs[i].dtype,
            nbytes(specs[i].shape, specs[i].dtype),
            [slot[i], end[tid]],
            view_of=root[tid],
            kind="output" if i in outputs else "intermediate",
        )
        for i, tid in enumerate(ids)
    ]
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
        ],
        constants=[],
        ops=[
            Op(i, "Reshape" if s.view else "Add", s.inputs, [ids[i]], memory_bound=s.memory_bound)
            for i, s in enumerate(specs)
        ],
        tensors=tensors,
        buffers=buffers,
        slots=[[i for i in range(len(specs)) if slot[i] == k] for k in range(last + 1)],
        sync_points=[SyncPoint(last, "phase end")],
        arena_bytes=arena,
        lower_bound_bytes=bound,
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
    specs: list[OpSpec] = []
    for i in range(n):
        available = list(EXTERNAL) + [f"x{j}" for j in range(i)]
        inputs = draw(st.lists(st.sampled_from(available), min_size=1, max_size=3, unique=True))
        specs.append(
            OpSpec(
                inputs=inputs,
                shape=draw(st.lists(st.integers(0, 9), max_size=3)),
                dtype=draw(st.sampled_from(["float16", "float32", "uint8", "bool"])),
                view=draw(st.booleans()) and draw(st.booleans()),
                memory_bound=draw(st.booleans()),
            )
        )
    outputs = {n - 1} | set(draw(st.lists(st.integers(0, n - 1), max_size=2)))
    return specs, outputs


GENERATED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@GENERATED
@given(graph=op_graphs())
def test_generated_valid_plans_pass(graph) -> None:
    plan = build_plan(*graph)
    assert verify_plan(plan) == []
    assert encode_plan(decode_plan(encode_plan(plan))) == encode_plan(plan)  # schema agrees too


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
    """A residual stream with per-layer chains, views and long-lived values (like a decoder)."""
    specs: list[OpSpec] = [OpSpec(["w_emb", "tok"], [1, 1, 3584], memory_bound=True)]
    for _ in range(layers):
        residual = f"x{len(specs) - 1}"
        for k in range(ops_per_layer):
            prev = f"x{len(specs) - 1}"
            if k % 7 == 3:
                specs.append(OpSpec([prev], [1, 28, 128], view=True))
            elif k % 5 == 0:
                specs.append(
                    OpSpec([prev, "w_emb"], [1, 1, 18944 if k % 2 else 3584], memory_bound=True)
                )
            else:
                specs.append(OpSpec([prev], [1, 1, 3584], dtype="float32" if k % 3 else "float16"))
        specs.append(OpSpec([f"x{len(specs) - 1}", residual], [1, 1, 3584]))
    return specs


def test_seven_b_sized_phase_verifies_quickly() -> None:
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
    assert verify_s < 5 and decode_s < 20  # generous: CI machines are slow; typical is well under


def test_rule_registry_is_complete_and_index_builds(tiny_plan: Plan) -> None:
    index = build_plan_index(tiny_plan)
    for name, rule in RULES.items():
        assert list(rule(index)) == [], name


def test_overlap_sweep_stays_fast_when_everything_is_live() -> None:
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
    start = time.perf_counter()
    assert list(RULES["arena_overlap"](index)) == []
    assert time.perf_counter() - start < 2
