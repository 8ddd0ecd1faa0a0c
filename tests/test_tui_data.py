"""dctms.tui.data and dctms.figures: the inspector's figures, checked without Textual."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from conftest import make_tiny_plan

from dctms.figures.comparison import plan_diff
from dctms.figures.memory import memory_curve
from dctms.figures.overview import arena_rows, table1
from dctms.figures.units import human
from dctms.schema.io import read_plan
from dctms.schema.modules import op_modules
from dctms.schema.sizes import lower_bound_bytes
from dctms.schema.types import Plan
from dctms.tui.data import (
    MODULE_ROW,
    PhaseLookup,
    Query,
    arena_bands,
    arena_placements,
    buffer_rows,
    buffer_summaries,
    describe_value,
    op_rows,
    parse_query,
    slot_rows,
    tensor_details,
    tensor_rows,
)
from dctms.tui.widgets.envelope_bar import split_cells

PLANS = Path(__file__).resolve().parent.parent / "plans"


def tiny_index() -> PhaseLookup:
    plan = make_tiny_plan()
    return PhaseLookup(plan.phases[0], plan.target.alignment, op_modules(plan, plan.phases[0]))


@pytest.fixture(scope="module")
def qwen7b() -> Plan:
    return read_plan(PLANS / "qwen7b.plan")


# ------------------------------------------------------------------------------------ memory curve


def test_tiny_curve_slot_by_slot():
    # t0 [0,2], scratch.3 [1,1], t2 [2,3], t3 [3,4], out [4,4], each 64 bytes aligned; t1 and k_out
    # are a view and state, so they add nothing.
    index = tiny_index()
    assert index.curve == [64, 128, 128, 128, 128]
    assert index.peak() == (1, 128)
    assert max(index.curve) == index.phase.lower_bound_bytes


def test_curve_brute_force_and_peak_is_the_plans_lower_bound(qwen7b: Plan):
    for phase in qwen7b.phases:
        index = PhaseLookup(phase, qwen7b.target.alignment)
        curve = index.curve
        assert len(curve) == len(phase.slots)
        for slot in range(0, len(curve), 97):  # every 97th slot, by brute force
            assert curve[slot] == sum(index.aligned(t) for t in index.live_at(slot))
        slot, peak = index.peak()
        assert peak == phase.lower_bound_bytes
        assert peak == lower_bound_bytes(phase.tensors, len(phase.slots), qwen7b.target.alignment)
        assert curve[slot] == peak and all(v < peak for v in curve[:slot])


def test_live_at_lists_arena_tenants_largest_first():
    index = tiny_index()
    assert [t.id for t in index.live_at(1)] == ["scratch.3", "t0"]  # equal aligned size: by id
    assert [t.id for t in index.live_at(4)] == ["out", "t3"]
    assert memory_curve(index.phase, 1)[1] == 16 + 8  # unaligned: t0 16 B + scratch 8 B


# ------------------------------------------------------------------------ producers and consumers


def test_producer_consumers_and_scratch_owner():
    index = tiny_index()
    d = tensor_details(index, "t2")
    assert d is not None
    assert d.producer is not None and (d.producer.index, d.producer.primitive) == (2, "Multiply")
    assert [op.index for op in d.consumers] == [4]
    assert d.layer == 0 and d.slot_of_producer == 2
    scratch = tensor_details(index, "scratch.3")
    assert scratch is not None and scratch.producer is not None
    assert (scratch.producer.index, scratch.producer.primitive) == (3, "DynamicSliceUpdate")
    assert [op.index for op in tensor_details(index, "t0").consumers] == [1, 3]
    assert tensor_details(index, "nope") is None
    assert describe_value(index, "w_emb") == "w_emb[16,8] float16"  # a binding, not a tensor


def test_every_real_tensor_has_a_producer(qwen7b: Plan):
    for phase in qwen7b.phases:
        index = PhaseLookup(phase, qwen7b.target.alignment)
        assert all(index.producer_op(t.id) is not None for t in phase.tensors)
        scratch = [t for t in phase.tensors if t.kind == "scratch"]
        assert scratch and all(index.producer[t.id] == int(t.id.split(".")[1]) for t in scratch)


# ----------------------------------------------------------------------------- rows and filters


def test_parse_query():
    assert parse_query("") == Query()
    assert parse_query("layer:3 prim:Matmul q_proj") == Query(3, "matmul", None, None, ("q_proj",))
    assert parse_query("l=2 buf:7 kind:scr") == Query(2, None, 7, "scr", ())
    assert parse_query("layer:x") == Query(words=("layer:x",))  # not a number: a plain word
    assert parse_query("mod:Self_Attn t2") == Query(words=("t2",), module="self_attn")


def test_tensor_rows_order_and_filters():
    index = tiny_index()
    rows = tensor_rows(index)
    assert [r.key for r in rows] == ["t0", "t1", "k_out", "scratch.3", "t2", "t3", "out"]
    assert rows[0].bars[0].start == 0 and rows[0].bars[0].end == 2 and rows[0].buffer == 0
    keys = lambda text: [r.key for r in tensor_rows(index, parse_query(text))]  # noqa: E731
    assert keys("prim:maximum") == ["t3"]
    assert keys("layer:0") == ["k_out", "scratch.3", "t2", "t3"]
    assert keys("buf:1") == ["scratch.3", "t2", "out"]
    assert keys("kind:scratch") == ["scratch.3"]
    assert keys("argmax") == ["out"]  # a plain word matches the producer's primitive too
    assert keys("layer:0 prim:multiply") == ["t2"]
    assert keys("nothing-like-this") == []


def test_buffer_rows_are_the_reuse_view():
    index = tiny_index()
    rows = buffer_rows(index)
    assert [(r.buffer, [b.tensor for b in r.bars]) for r in rows] == [
        (0, ["t0", "t3"]),
        (1, ["scratch.3", "t2", "out"]),
    ]
    assert [b.shade for b in rows[1].bars] == [0, 1, 0]  # neighbours alternate
    assert [r.buffer for r in buffer_rows(index, parse_query("t3"))] == [0]
    summary = buffer_summaries(index)
    assert [
        (s.id, s.bytes, s.tenants, s.first_slot, s.last_slot, s.busy_slots) for s in summary
    ] == [
        (0, 16, 2, 0, 4, 5),
        (1, 16, 3, 1, 4, 4),
    ]


def test_arena_bands():
    index = tiny_index()
    placements = arena_placements(index)
    assert {p.tensor for p in placements} == {"t0", "t2", "scratch.3", "t3", "out"}
    bands = arena_bands(placements, 128, 2)  # [0, 64) and [64, 128)
    assert {p.tensor for p in bands[0]} == {"t0", "t3"}
    assert {p.tensor for p in bands[1]} == {"t2", "scratch.3", "out"}
    assert arena_bands(placements, 0, 3) == [[], [], []]


def test_slot_rows_and_op_rows():
    index = tiny_index()
    rows = slot_rows(index)
    assert [[op.index for op in r.ops] for r in rows] == [[0], [1, 3], [2], [4], [5]]
    assert [r.live_bytes for r in rows] == [64, 128, 128, 128, 128]
    assert [r.sync for r in rows] == ["", "", "", "", "sample next token"]
    assert [r.memory_bound for r in rows] == [1, 0, 1, 0, 0]
    assert [op.index for op in op_rows(index, parse_query("layer:0"))] == [2, 3, 4]
    assert [op.index for op in op_rows(index, parse_query("t2"))] == [2, 4]  # writes or reads t2


# ---------------------------------------------------------------------------------- overview


def test_overview_figures_match_the_plan():
    plan = make_tiny_plan()
    t1 = table1(plan)
    assert (t1.logical_tensors, t1.physical_buffers) == (
        plan.stats.logical_tensors,
        plan.stats.physical_buffers,
    )
    assert (t1.paper_logical, t1.paper_physical, round(t1.paper_reduction, 4)) == (448, 122, 0.7277)
    rows = arena_rows(plan)
    assert [(r.name, r.arena, r.lower_bound) for r in rows] == [
        ("decode", 128, 128),
        ("max over phases", 128, 128),
    ]


def test_split_cells_keeps_edges_exact():
    cells = split_cells([1, 1, 1], 3, 10)
    assert sum(cells) == 10 and cells == [3, 4, 3]
    assert split_cells([5, 0, 5], 20, 8) == [2, 0, 2]
    assert (
        sum(split_cells([4284263424, 132120576, 2168, 409223296, 476332160], 5301941624, 117))
        == 117
    )


def test_short_size_format():
    assert human(128, 1) == "128 B"
    assert human(1536, 1) == "1.5 KiB"
    assert human(409223296, 1) == "390.3 MiB"


# -------------------------------------------------------------------------------------- diff


def bigger_runtime(plan: Plan, extra: int) -> Plan:
    e = plan.envelope
    envelope = msgspec.structs.replace(
        e, runtime=e.runtime + extra, total=e.total + extra, free=e.free - extra
    )
    model = msgspec.structs.replace(plan.model, architecture="tiny2")
    return msgspec.structs.replace(plan, envelope=envelope, model=model)


def test_diff_envelope_delta_and_fingerprint():
    old = make_tiny_plan()
    new = bigger_runtime(old, 2**20)
    diff = plan_diff(old, new)
    by_name = {d.name: d for d in diff.envelope}
    runtime = by_name["runtime"]
    assert (runtime.old, runtime.new, runtime.delta) == (1024, 1024 + 2**20, 2**20)
    assert runtime.delta_mib == 1.0 and runtime.percent == pytest.approx(102400.0)
    assert by_name["total = M_max"].delta == 2**20 and by_name["free"].delta == -(2**20)
    assert by_name["weights"].delta == 0 and not by_name["weights"].changed
    changed = {c.name for c in diff.fingerprint if c.changed}
    assert changed == {"model architecture"}
    assert not any(c.changed for c in diff.bounds)
    assert diff.changed == 4  # runtime, total, free, architecture
    assert plan_diff(old, old).changed == 0


def test_diff_of_the_two_checked_in_plans(qwen7b: Plan):
    small = read_plan(PLANS / "qwen1.5b.plan")
    diff = plan_diff(small, qwen7b)
    env = {d.name: d for d in diff.envelope}
    assert env["weights"].delta == qwen7b.envelope.weights - small.envelope.weights
    fp = {c.name: c for c in diff.fingerprint}
    assert fp["config sha256"].changed and fp["weights layout sha256"].changed
    assert fp["weights count"].new_text == f"{qwen7b.model.weights.count:,}"
    t1 = {d.name: d for d in diff.table1}
    assert t1["logical tensors"].delta == qwen7b.stats.logical_tensors - small.stats.logical_tensors
    phases = {d.name: d for d in diff.phases}
    assert phases["decode arena"].new == qwen7b.phases[1].arena_bytes


def test_module_of_ops_and_tensors_and_search_by_module():
    index = tiny_index()
    assert index.op_module(0) == "model.embed_tokens" and index.op_module(5) == "(step)"
    assert index.module_of("t2") == "model.layers.0.self_attn"
    assert index.module_of("scratch.3") == "model.layers.0.self_attn"  # its op's module
    assert index.module_of("tok") is None  # a graph input
    assert [op.index for op in op_rows(index, parse_query("mod:embed"))] == [0, 1]
    assert [op.index for op in op_rows(index, parse_query("self_attn"))] == [2, 3, 4]
    keys = [r.key for r in tensor_rows(index, parse_query("m:step"))]
    assert keys == ["out"]
    assert "0.self_attn" in next(r.label for r in tensor_rows(index) if r.key == "t2")


def test_tensor_rows_grouped_by_module():
    index = tiny_index()
    plain = [r.key for r in tensor_rows(index)]
    rows = tensor_rows(index, by_module=True)
    headings = [r for r in rows if r.key.startswith(MODULE_ROW)]
    grouped = [r.key for r in rows if r not in headings]
    assert sorted(plain) == sorted(grouped)
    modules = [index.module_of(k) for k in grouped]
    # each module's tensors together, modules in order of first use, slot order inside
    runs = [m for i, m in enumerate(modules) if i == 0 or m != modules[i - 1]]
    assert len(runs) == len(set(runs))
    assert runs == ["model.embed_tokens", "model.layers.0.self_attn", "(step)"]
    # ... each group under a heading row (no bars) naming its module: the grouping shows
    assert [r.label for r in headings] == [f"▸ {m}" for m in runs]
    assert all(not r.bars for r in headings) and rows[0] is headings[0]
    for h in headings:  # ... just before the group's first tensor
        after = rows[rows.index(h) + 1]
        assert index.module_of(after.key) == h.key[len(MODULE_ROW) :]
