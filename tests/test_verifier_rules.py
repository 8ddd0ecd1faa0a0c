"""Each verifier rule, shown able to fail: a valid plan broken in exactly that way must be reported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import make_tiny_plan
from msgspec.structs import replace

from dctms.schema.fingerprint import canonical_config_sha256
from dctms.schema.types import (
    Binding,
    Buffer,
    CompileRequest,
    Constant,
    Distributed,
    EnvelopePart,
    FusedWeight,
    Intermediate,
    LengthAffine,
    Lengths,
    ModuleRuns,
    Plan,
    RankShard,
    SyncPoint,
    as_kind,
)
from dctms.schema.verify import MAX_PER_RULE, RULES, verify_plan

# ----------------------------------------------------------------------------------------- helpers

P0 = lambda p: p.phases[0]  # noqa: E731


def phase(plan: Plan, **changes) -> Plan:
    return replace(plan, phases=[replace(plan.phases[0], **changes)])


def tensor(plan: Plan, tensor_id: str, **changes) -> Plan:
    tensors = [replace(t, **changes) if t.id == tensor_id else t for t in plan.phases[0].tensors]
    return phase(plan, tensors=tensors)


def op(plan: Plan, op_index: int, /, **changes) -> Plan:
    ops = [replace(o, **changes) if i == op_index else o for i, o in enumerate(plan.phases[0].ops)]
    return phase(plan, ops=ops)


def binding(plan: Plan, field: str, binding_id: str, **changes) -> Plan:
    items = [
        replace(b, **changes) if b.id == binding_id else b for b in getattr(plan.phases[0], field)
    ]
    return phase(plan, **{field: items})


def nested(plan: Plan, field: str, **changes) -> Plan:
    return replace(plan, **{field: replace(getattr(plan, field), **changes)})


def weights(plan: Plan, **changes) -> Plan:
    return replace(plan, model=replace(plan.model, weights=replace(plan.model.weights, **changes)))


EMB = "model.embed_tokens.weight"


def fused(plan: Plan, parts: list[str], name: str = "fused", **second) -> Plan:
    """``plan`` with a second weight (``emb2``, like the embedding unless ``second`` changes it)
    and one fused weight of ``parts``."""
    emb = plan.model.weights.tensors[0]
    extra = replace(emb, name="emb2", **second)
    return weights(plan, tensors=[emb, extra], fused=[FusedWeight(name, parts)])


TINY_CONFIG = {"model_type": "tiny", "hidden_size": 8}


def with_request(plan: Plan, config: dict | None = None, **changes) -> Plan:
    """``plan`` with the compile request that made it (matching bounds, target and the hash of
    TINY_CONFIG), then the request's ``config`` and ``changes`` replaced."""
    fields = {"input_tokens": 8, "output_tokens": 8, "device_memory": 2**20} | changes
    request = CompileRequest(config=TINY_CONFIG if config is None else config, **fields)
    model = replace(plan.model, config_sha256=canonical_config_sha256(TINY_CONFIG))
    return replace(plan, model=model, compile=request)


def _output_ends_early(plan: Plan) -> Plan:
    """t2 becomes a phase output (evaluated at the sync point), but keeps its interval [2, 3] (the
    phase ends in slot 4)."""
    tensors = [as_kind(t, "output") if t.id == "t2" else t for t in P0(plan).tensors]
    plan = phase(plan, tensors=tensors)
    extra = Binding("t2", "output", "hidden", [1, 8], "float16")
    sync = SyncPoint(4, "sample next token", evaluate=["k_out", "t2", "out"])
    return phase(plan, outputs=P0(plan).outputs + [extra], sync_points=[sync])


def _two_segments(plan: Plan) -> Plan:
    """A valid variant with a sync point after slot 2 (t2 crosses it, so it is evaluated there)."""
    return phase(
        plan,
        sync_points=[
            SyncPoint(2, "end of layer 0", evaluate=["k_out", "t2"]),
            SyncPoint(4, "sample next token", evaluate=["out"]),
        ],
    )


def _donated(plan: Plan, **t3) -> Plan:
    """A valid variant where Maximum (op 4) writes t3 into t2's buffer, which MLX donates: t2 is
    read by op 4 alone, in the same segment, and is not evaluated. ``t3`` changes t3 further."""
    tensors = []
    for t in P0(plan).tensors:
        if t.id == "t3":
            t = replace(t, **{"view_of": "t2", "buffer": None, "offset": None, **t3})
        elif t.id == "t2":
            t = replace(t, interval=[2, 4])
        elif t.id == "out":
            t = replace(t, buffer=0, offset=0)
        tensors.append(t)
    plan = replace(plan, stats=replace(plan.stats, logical_tensors=4, reduction=0.5))
    return phase(plan, tensors=tensors)


def _donated_ops(plan: Plan, **op4) -> Plan:
    return op(_donated(plan), 4, **op4)


def _donated_sync(plan: Plan, evaluate: list[str], slot: int = 4) -> Plan:
    extra = [SyncPoint(slot, "end of layer 0", evaluate=evaluate)] if slot != 4 else []
    last = SyncPoint(4, "sample next token", evaluate=["k_out", "out", *evaluate])
    return phase(_donated(plan), sync_points=[*extra, last] if extra else [last])


# ------------------------------------------------------------------------------- one case per break

Break = Callable[[Plan], Plan]


def _with_lengths(plan: Plan, **changes) -> Plan:
    """The tiny decode phase as a real-length phase over its attention window: a consistent record
    (op 1's ``[1, 8]`` reshape holds 8 = 0 * window + 8 only in the broken cases' functions)."""
    record = Lengths(names=["window"], bound=[15], points=[[15], [8]], affine=[])
    return phase(plan, lengths=replace(record, **changes))


def _constant_index(plan: Plan, op_index: int, slot: int, value: int, dtype: str) -> Plan:
    """Op ``op_index`` reading its input ``slot`` (an index) from a new constant of ``value``
    (shaped like a token id, or a 1-d start), as an edited plan would."""
    shape = [1] if P0(plan).ops[op_index].primitive.startswith("Dynamic") else [1, 1]
    plan = phase(plan, constants=[*P0(plan).constants, Constant("c_index", shape, dtype, [value])])
    inputs = list(P0(plan).ops[op_index].inputs)
    inputs[slot] = "c_index"
    return op(plan, op_index, inputs=inputs)


def _metal_model(plan: Plan) -> Plan:
    """A metal allocator model on the tiny plan's CPU target (tests/test_targets.py breaks the
    model's own figures on a compiled metal plan)."""
    from dctms.schema.targets import derive

    return nested(plan, "target", memory_model=derive("metal", "apple-m4-16gb"))


def _unsplit_qmm(plan: Plan) -> Plan:
    """A metal plan whose op 2 is a quantised matmul Metal runs as qvm_split_k (one row of 2,048
    against a weight that is not transposed) charged no scratch (tests/test_gpu_qmm.py breaks a
    compiled GPU plan)."""
    plan = _metal_model(plan)
    x, w = Constant("c_x", [1, 2048], "float16", [0.0]), Constant("c_w", [2048, 1], "uint32", [0])
    plan = phase(plan, constants=[*P0(plan).constants, x, w])
    return op(
        plan, 2, primitive="QuantizedMatmul", inputs=["c_x", "c_w"], args=[64, 4, "affine", False]
    )


CASES: list[tuple[str, str, Break]] = [
    ("unique_ids", "duplicate tensor id", lambda p: tensor(p, "t2", id="t0")),
    ("memory_model", "a metal model on a cpu target", _metal_model),
    ("gpu_matmul", "a metal qvm_split_k charged no partials", _unsplit_qmm),
    (
        "unique_ids",
        "op output without tensor record",
        lambda p: phase(p, tensors=[t for t in P0(p).tensors if t.id != "t3"]),
    ),
    (
        "unique_ids",
        "tensor record without producer",
        lambda p: phase(
            p, tensors=P0(p).tensors + [Intermediate("ghost", [1], "uint8", 1, [0, 0])]
        ),
    ),
    (
        "unique_ids",
        "duplicate buffer id",
        lambda p: phase(p, buffers=[Buffer(0, 16), Buffer(0, 16)]),
    ),
    ("unique_ids", "op redefines a constant", lambda p: op(p, 4, outputs=["c_half"])),
    ("op_inputs_defined", "input never defined", lambda p: op(p, 2, inputs=["nope", "c_half"])),
    ("op_inputs_defined", "input produced later", lambda p: op(p, 1, inputs=["t2"])),
    (
        "outputs_defined",
        "output binding names nothing",
        lambda p: binding(p, "outputs", "out", id="ghost"),
    ),
    (
        "slots_cover",
        "consumer scheduled before producer",
        lambda p: phase(p, slots=[[0], [2], [1, 3], [4], [5]]),
    ),
    (
        "slots_cover",
        "producer and consumer in one slot",
        lambda p: phase(p, slots=[[0], [1, 3, 2], [4], [5]]),
    ),
    (
        "slots_cover",
        "op scheduled twice",
        lambda p: phase(p, slots=[[0], [1, 3], [2], [4], [5, 5]]),
    ),
    (
        "slots_cover",
        "op missing and empty slot",
        lambda p: phase(p, slots=[[0], [1, 3], [2], [4], []]),
    ),
    (
        "slots_cover",
        "unknown op in slot",
        lambda p: phase(p, slots=[[0], [1, 3], [2], [4], [5, 9]]),
    ),
    (
        "slot_bandwidth",
        "two memory-bound ops in a slot",
        lambda p: op(op(p, 1, memory_bound=True), 3, memory_bound=True),
    ),
    (
        "sync_points",
        "last slot not a sync point",
        lambda p: phase(p, sync_points=[SyncPoint(2, "x")]),
    ),
    (
        "sync_points",
        "sync point beyond the slots",
        lambda p: phase(p, sync_points=[SyncPoint(4, "x"), SyncPoint(9, "y")]),
    ),
    (
        "sync_points",
        "sync points out of order",
        lambda p: phase(p, sync_points=[SyncPoint(4, "x"), SyncPoint(2, "y"), SyncPoint(4, "z")]),
    ),
    (
        "module_layer",
        "module in a layer beyond the model",
        lambda p: nested(p, "modules", names=[*p.modules.names[:4], "1", "self_attn"]),
    ),
    (
        "module_tree",
        "module whose parent comes after it",
        lambda p: nested(p, "modules", parents=[-1, -1, 1, 1, 5, 4]),
    ),
    (
        "module_tree",
        "module name with a dot",
        lambda p: nested(p, "modules", names=[*p.modules.names[:5], "self.attn"]),
    ),
    (
        "module_runs",
        "module runs cover fewer ops than the phase has",
        lambda p: phase(p, modules=ModuleRuns([2, 2, 1], [2, 5, 0])),
    ),
    (
        "module_runs",
        "module run naming no node of the tree",
        lambda p: phase(p, modules=ModuleRuns([2, 3, 1], [2, 6, 0])),
    ),
    (
        "unique_ids",
        "one weight bound twice",
        lambda p: phase(p, inputs=P0(p).inputs + [replace(P0(p).inputs[2], id="w_again")]),
    ),
    (
        "view_root",
        "view made by an op that does not read the root",
        lambda p: op(p, 1, inputs=["tok"]),
    ),
    ("dtype_known", "unknown tensor dtype", lambda p: tensor(p, "t2", dtype="float17")),
    ("dtype_known", "unknown bounds dtype", lambda p: nested(p, "bounds", dtype="fp8")),
    ("tensor_bytes", "tensor bytes wrong", lambda p: tensor(p, "t2", bytes=15)),
    (
        "tensor_bytes",
        "weight bytes wrong",
        lambda p: weights(
            p, tensors=[replace(p.model.weights.tensors[0], bytes=255)], total_bytes=255
        ),
    ),
    (
        "constant_size",
        "constant value count wrong",
        lambda p: phase(
            p, constants=[P0(p).constants[0], replace(P0(p).constants[1], value=[1.0, 2.0])]
        ),
    ),
    ("interval_bounds", "interval beyond the slots", lambda p: tensor(p, "t3", interval=[3, 9])),
    ("interval_bounds", "interval reversed", lambda p: tensor(p, "t3", interval=[4, 3])),
    ("interval_bounds", "interval with one element", lambda p: tensor(p, "t3", interval=[3])),
    (
        "interval_producer",
        "interval starts before its producer",
        lambda p: tensor(p, "t2", interval=[1, 3]),
    ),
    (
        "interval_last_use",
        "lives past the sync point after its last read",
        lambda p: tensor(_two_segments(p), "t0", interval=[0, 3]),
    ),
    (
        "interval_last_use",
        "ends before its last reader",
        lambda p: tensor(p, "t3", interval=[3, 3]),
    ),
    ("interval_last_use", "root ends before its view", lambda p: tensor(p, "t0", interval=[0, 1])),
    (
        "interval_last_use",
        "phase output ends before the last slot",
        lambda p: _output_ends_early(p),
    ),
    ("scratch", "scratch bytes differ from the op's", lambda p: op(p, 3, scratch=16)),
    ("scratch", "op declares scratch without a tensor", lambda p: op(p, 4, scratch=8)),
    ("scratch", "scratch tensor names no op", lambda p: tensor(p, "scratch.3", op=9)),
    (
        "scratch",
        "scratch tensor with a wrong shape",
        lambda p: tensor(p, "scratch.3", shape=[2, 4]),
    ),
    (
        "sync_points",
        "a phase output evaluated at no sync point",
        lambda p: phase(p, sync_points=[SyncPoint(4, "x", evaluate=["k_out"])]),
    ),
    (
        "sync_points",
        "evaluates an input binding (no op makes it)",
        lambda p: phase(p, sync_points=[SyncPoint(4, "x", evaluate=["k_out", "tok", "out"])]),
    ),
    (
        "sync_points",
        "evaluates a tensor made before the previous sync point",
        lambda p: phase(
            _two_segments(p),
            sync_points=[
                SyncPoint(2, "a", evaluate=["k_out", "t2"]),
                SyncPoint(4, "b", evaluate=["t0", "out"]),
            ],
        ),
    ),
    (
        "sync_points",
        "evaluates a tensor made after the sync point",
        lambda p: phase(
            _two_segments(p),
            sync_points=[
                SyncPoint(2, "a", evaluate=["k_out", "t2", "t3"]),
                SyncPoint(4, "b", evaluate=["out"]),
            ],
        ),
    ),
    (
        "sync_points",
        "a tensor read after the sync point is not evaluated there",
        lambda p: phase(
            p,
            sync_points=[
                SyncPoint(2, "a", evaluate=["k_out"]),
                SyncPoint(4, "b", evaluate=["out"]),
            ],
        ),
    ),
    (
        "view_root",
        "state tensor aliasing a non-state input",
        lambda p: tensor(p, "k_out", view_of="tok"),
    ),
    (
        "arena_bounds",
        "allocator slack not recomputed",
        lambda p: phase(replace(p, target=replace(p.target, allocator_slack=8)), slack_bytes=0),
    ),
    (
        "envelope_sum",
        "intermediate without the phase's slack",
        lambda p: phase(p, slack_bytes=16),
    ),
    ("view_root", "view of an unknown tensor", lambda p: tensor(p, "t1", view_of="t9")),
    ("view_root", "view of itself", lambda p: tensor(p, "t1", view_of="t1")),
    (
        "view_root",
        "view of a view",
        lambda p: tensor(p, "t2", view_of="t1", buffer=None, offset=None),
    ),
    ("view_root", "view with a buffer and offset", lambda p: tensor(p, "t1", buffer=0, offset=0)),
    ("arena_overlap", "live tensors share bytes", lambda p: tensor(p, "t2", offset=0)),
    ("arena_overlap", "partial byte overlap", lambda p: tensor(p, "t3", offset=64, buffer=1)),
    ("buffer_overlap", "live tensors share a buffer", lambda p: tensor(p, "t2", buffer=0)),
    ("buffer_holds_tenants", "tenant without buffer", lambda p: tensor(p, "t2", buffer=None)),
    ("buffer_holds_tenants", "tenant without offset", lambda p: tensor(p, "t2", offset=None)),
    ("buffer_holds_tenants", "unknown buffer", lambda p: tensor(p, "t2", buffer=7)),
    ("buffer_holds_tenants", "offset not aligned", lambda p: tensor(p, "t2", offset=96)),
    (
        "buffer_holds_tenants",
        "tenant larger than its buffer",
        lambda p: phase(p, buffers=[Buffer(0, 16), Buffer(1, 8)]),
    ),
    (
        "view_root",
        "state tensor (aliasing its input) with an offset",
        lambda p: tensor(p, "k_out", offset=0),
    ),
    (
        "buffer_holds_tenants",
        "state tensor with a buffer and no view_of",
        lambda p: tensor(p, "k_out", view_of=None, buffer=0),
    ),
    (
        "buffer_sized",
        "buffer larger than its largest tenant",
        lambda p: phase(p, buffers=[Buffer(0, 16), Buffer(1, 32)]),
    ),
    (
        "buffer_sized",
        "buffer without tenants",
        lambda p: phase(p, buffers=P0(p).buffers + [Buffer(2, 16)]),
    ),
    ("arena_bounds", "arena smaller than a tenant's end", lambda p: phase(p, arena_bytes=100)),
    (
        "arena_bounds",
        "lower bound not the recomputed one",
        lambda p: phase(p, lower_bound_bytes=96),
    ),
    (
        "arena_bounds",
        "lower bound above the arena",
        lambda p: phase(tensor(tensor(p, "t3", offset=64), "out", offset=0), arena_bytes=96),
    ),
    (
        "arena_claim",
        "claims the lower bound above it",
        lambda p: phase(p, arena_bytes=192, lower_bound_bytes=128, arena_optimal="lower_bound"),
    ),
    (
        "arena_claim",
        "reaches the lower bound without claiming it",
        lambda p: phase(p, arena_optimal=None, arena_gap_bytes=64),
    ),
    (
        "arena_claim",
        "proven optimal with a gap",
        lambda p: phase(p, arena_bytes=192, arena_optimal="search", arena_gap_bytes=64),
    ),
    (
        "arena_claim",
        "unproven without a gap",
        lambda p: phase(p, arena_bytes=192, arena_optimal=None, arena_gap_bytes=0),
    ),
    (
        "arena_claim",
        "gap wider than arena minus the lower bound",
        lambda p: phase(p, arena_bytes=192, arena_optimal=None, arena_gap_bytes=128),
    ),
    ("bounds", "batch 0", lambda p: nested(p, "bounds", batch=0)),
    ("bounds", "input_tokens 0", lambda p: nested(p, "bounds", input_tokens=0)),
    ("bounds", "prefill_chunk 0", lambda p: nested(p, "bounds", prefill_chunk=0)),
    ("bounds", "kv capacity below N + M", lambda p: nested(p, "bounds", kv_capacity=15)),
    (
        "bounds",
        "padded last chunk does not fit",
        lambda p: nested(
            p, "bounds", input_tokens=9, output_tokens=1, prefill_chunk=8, kv_capacity=12
        ),
    ),
    (
        "bounds",
        "quantised KV without group size",
        lambda p: nested(p, "bounds", kv=replace(p.bounds.kv, bits=4)),
    ),
    ("bounds", "phase processes no tokens", lambda p: phase(p, tokens=0)),
    (
        "state_kind",
        "unknown state kind",
        lambda p: replace(p, state=[replace(p.state[0], kind="cache")]),
    ),
    ("weights_fingerprint", "count wrong", lambda p: weights(p, count=2)),
    ("weights_fingerprint", "total wrong", lambda p: weights(p, total_bytes=257)),
    ("weights_fingerprint", "layout hash stale", lambda p: weights(p, layout_sha256="f" * 64)),
    (
        "weights_fingerprint",
        "tensor renamed without rehashing",
        lambda p: weights(p, tensors=[replace(p.model.weights.tensors[0], name="embed")]),
    ),
    (
        "bindings",
        "weight binding shape differs",
        lambda p: binding(p, "inputs", "w_emb", shape=[8, 16]),
    ),
    ("bindings", "unknown weight", lambda p: binding(p, "inputs", "w_emb", name="lm_head.weight")),
    ("bindings", "unknown state", lambda p: binding(p, "inputs", "k_in", name="layers.9.keys")),
    (
        "bindings",
        "state binding dtype differs",
        lambda p: binding(p, "inputs", "k_in", dtype="float32"),
    ),
    (
        "bindings",
        "output binding as an input",
        lambda p: binding(p, "inputs", "tok", kind="output"),
    ),
    (
        "bindings",
        "output tensor not bound",
        lambda p: binding(p, "outputs", "out", id="t3", kind="output"),
    ),
    ("bindings", "output binding shape differs", lambda p: binding(p, "outputs", "out", shape=[2])),
    ("donation", "a matmul aliases its input", lambda p: _donated_ops(p, primitive="Matmul")),
    # the KV update (op 3, slot 1) would copy: op 0 reads k_in before it in the same segment,
    # op 4 reads it after it
    ("state_in_place", "a read before the update, no sync between", lambda p: op(p, 0, inputs=["k_in", "tok"])),
    ("state_in_place", "a read after the update", lambda p: op(p, 4, inputs=["t2", "k_in"])),
    ("donation", "two outputs", lambda p: _donated_ops(p, outputs=["t3", "t3b"])),
    ("donation", "the donor read twice", lambda p: _donated_ops(p, inputs=["t2", "t2"])),
    ("donation", "the donor evaluated", lambda p: _donated_sync(p, ["t2"])),
    ("donation", "a sync point between", lambda p: _donated_sync(p, ["t2"], slot=2)),
    ("donation", "a constant donated", lambda p: _donated(p, view_of="c_floor")),
    ("donation", "another itemsize", lambda p: _donated(p, dtype="float32", bytes=32)),
    (
        "donation",
        "the output is evaluated",
        lambda p: phase(
            _donated(p),
            sync_points=[SyncPoint(4, "sample next token", evaluate=["k_out", "out", "t3"])],
        ),
    ),
    (
        "compile_request",
        "a run-ahead mode the target does not record",
        lambda p: nested(with_request(p, run_ahead="free"), "target", run_ahead_dispatches=10),
    ),
    (
        "constant_values",
        "past int64 (MLX cannot build it)",
        lambda p: phase(
            p, constants=[replace(P0(p).constants[0], value=[2**63]), *P0(p).constants[1:]]
        ),
    ),
    (
        "constant_values",
        "a negative uint8",
        lambda p: phase(
            p,
            constants=[
                replace(P0(p).constants[0], dtype="uint8", value=[-1]),
                *P0(p).constants[1:],
            ],
        ),
    ),
    (
        "constant_values",
        "not a number",
        lambda p: phase(
            p, constants=[replace(P0(p).constants[0], value=["x"]), *P0(p).constants[1:]]
        ),
    ),
    ("fused_weights", "a fused weight of one part", lambda p: fused(p, ["emb2"])),
    ("fused_weights", "a part that is not a weight", lambda p: fused(p, ["emb2", "nope"])),
    ("fused_weights", "a part named twice", lambda p: fused(p, ["emb2", "emb2"])),
    ("fused_weights", "named like a weight", lambda p: fused(p, [EMB, "emb2"], name="emb2")),
    ("fused_weights", "parts of two dtypes", lambda p: fused(p, [EMB, "emb2"], dtype="float32")),
    ("fused_weights", "parts of other widths", lambda p: fused(p, [EMB, "emb2"], shape=[16, 4])),
    ("fused_weights", "a phase binds a part", lambda p: fused(p, [EMB, "emb2"])),
    (
        "fused_weights",
        "a part cast at load",
        lambda p: fused(p, ["emb2", EMB], stored_dtype="float32"),
    ),
    (
        "envelope_sum",
        "total is not the sum",
        lambda p: nested(p, "envelope", total=1665, free=2**20 - 1665),
    ),
    ("envelope_sum", "free is not device - total", lambda p: nested(p, "envelope", free=0)),
    (
        "envelope_sum",
        "kv differs from the state",
        lambda p: nested(p, "envelope", kv=0, total=1408, free=2**20 - 1408),
    ),
    (
        "envelope_sum",
        "intermediate below the arena",
        lambda p: nested(p, "envelope", intermediate=64, runtime=1088),
    ),
    (
        "envelope_sum",
        "device differs from the target",
        lambda p: nested(p, "envelope", device=None, free=None),
    ),
    (
        "stats",
        "logical tensors wrong (scratch tenant not counted)",
        lambda p: nested(p, "stats", logical_tensors=4, reduction=0.5),
    ),
    (
        "stats",
        "physical buffers wrong",
        lambda p: nested(p, "stats", physical_buffers=3, reduction=0.4),
    ),
    ("stats", "reduction wrong", lambda p: nested(p, "stats", reduction=0.4)),
    ("stats", "arena wrong", lambda p: nested(p, "stats", arena_bytes=64)),
    ("stats", "lower bound wrong", lambda p: nested(p, "stats", lower_bound_bytes=64)),
    ("lengths", "a point above the bound", lambda p: _with_lengths(p, points=[[15], [20]])),
    (
        "index_safety",
        "a constant KV write start of 2^31 - 1",
        lambda p: _constant_index(p, 3, 2, 2**31 - 1, "int32"),
    ),
    (
        "index_safety",
        "a constant KV write start of -2^31",
        lambda p: _constant_index(p, 3, 2, -(2**31), "int32"),
    ),
    (
        "index_safety",
        "a constant token gather index of 2^32 - 1",
        lambda p: _constant_index(p, 0, 1, 2**32 - 1, "uint32"),
    ),
    (
        "index_safety",
        "a lengths slope of -1 (the reshape holds 8 at the bound, 15 at the point 8)",
        lambda p: _with_lengths(p, affine=[LengthAffine([-1], 23, ["o1/0.1"])]),
    ),
    ("lengths", "the bound not among the points", lambda p: _with_lengths(p, points=[[8]])),
    (
        "lengths",
        "a window that is the whole cache (no proper slice)",
        lambda p: _with_lengths(p, bound=[16], points=[[16]]),
    ),
    (
        "lengths",
        "a tokens bound other than the phase's",
        lambda p: _with_lengths(p, names=["tokens"], bound=[2], points=[[2]]),
    ),
    (
        "lengths",
        "an argument the function does not give at the bound",
        lambda p: _with_lengths(p, affine=[LengthAffine([1], 0, ["o1/0.1"])]),
    ),
    (
        "lengths",
        "an input axis that shrinks as the window grows",
        lambda p: _with_lengths(p, affine=[LengthAffine([-1], 16, ["itok/1"])]),
    ),
    (
        "lengths",
        "a place that does not exist",
        lambda p: _with_lengths(p, affine=[LengthAffine([0], 8, ["o99/0.1"])]),
    ),
    (
        "compile_request",
        "config edited after hashing",
        lambda p: with_request(p, config={"model_type": "tiny", "hidden_size": 16}),
    ),
    (
        "compile_request",
        "config of another architecture",
        lambda p: with_request(replace(p, model=replace(p.model, architecture="qwen2"))),
    ),
    ("compile_request", "N differs from bounds", lambda p: with_request(p, input_tokens=9)),
    ("compile_request", "M differs from bounds", lambda p: with_request(p, output_tokens=7)),
    ("compile_request", "batch differs", lambda p: with_request(p, batch=2)),
    ("compile_request", "chunk differs", lambda p: with_request(p, prefill_chunk=8)),
    ("compile_request", "dtype differs", lambda p: with_request(p, dtype="float32")),
    ("compile_request", "backend differs", lambda p: with_request(p, backend="gpu")),
    ("compile_request", "alignment differs", lambda p: with_request(p, alignment=128)),
    ("compile_request", "profile differs", lambda p: with_request(p, profile="apple-m4-16gb")),
    ("compile_request", "memory differs", lambda p: with_request(p, device_memory=2**21)),
    (
        "compile_request",
        "file hashes without hash_weights",
        lambda p: weights(with_request(p), files_sha256={"model.safetensors": "a" * 64}),
    ),
    # what the runner looks up and the indices it feeds (schema/rules_runner.py)
    ("runner_names", "a prefill phase without last_index", lambda p: _with_prefill(p)),
    (
        "runner_names",
        "decode input renamed",
        lambda p: _with_prefill(binding(p, "inputs", "pos", name="pos")),
    ),
    (
        "runner_names",
        "next_token renamed",
        lambda p: _with_prefill(binding(p, "outputs", "out", name="token")),
    ),
    ("compile_request", "kv bits differ from bounds.kv", lambda p: with_request(p, kv_bits=4)),
    (
        "prefix_pool",
        "a prefix-pool state in a plan whose bounds have no pool",
        lambda p: replace(p, state=[*p.state, replace(p.state[0], name="layers.0.keys.pool")]),
    ),
    (
        "quantized_start",
        "a quantised KV cache without its prefill_start phase",
        lambda p: _with_prefill(
            nested(p, "bounds", kv=replace(p.bounds.kv, bits=4, group_size=32))
        ),
    ),
    (
        "quantized_start",
        "a prefill_start phase over a float KV cache",
        lambda p: replace(p, phases=[*p.phases, replace(P0(p), name="prefill_start")]),
    ),
    (
        "quantized_start",
        "a decode_start phase over a float KV cache",
        lambda p: replace(
            _with_prefill(p), phases=[*_with_prefill(p).phases, replace(P0(p), name="decode_start")]
        ),
    ),
    (
        "sampling",
        "a --sampling plan whose phases lack the sampling inputs",
        lambda p: with_request(_with_prefill(p), sampling=True),
    ),
    ("vocabulary", "vocab_size 0", lambda p: nested(p, "model", vocab_size=0)),
    ("vocabulary", "vocab_size beyond the embedding", lambda p: nested(p, "model", vocab_size=17)),
    (
        "state_capacity",
        "kv_capacity beyond the cache",
        lambda p: nested(p, "bounds", kv_capacity=17),
    ),
    ("state_capacity", "cache written at a constant", lambda p: _state_written_at(p, "c_half")),
    ("state_capacity", "a ring written at the position", lambda p: _ring(p, slots=16)),
    ("op_arguments", "a shape of 10^12", lambda p: op(p, 1, args=[[10**12, 8]])),
    # re-derived figures (schema/rules_derived.py); the first two only for runnable plans
    ("persistent_state", "no persistent state", lambda p: _with_prefill(p)),
    ("runtime_floor", "runtime below the process baseline", lambda p: _with_prefill(p)),
    ("dynamic_scratch", "DynamicSliceUpdate without its offset", lambda p: _no_dynamic_scratch(p)),
    # mx.fast kernels (schema/rules_fused.py; tests/test_fused_kernels.py breaks real plans)
    ("fused_kernels", "an RMSNorm whose eps is an int", lambda p: op(p, 1, primitive="RMSNorm", args=[1])),
    (
        "run_ahead",
        "run-ahead declared, lifetimes not widened",
        lambda p: nested(p, "target", run_ahead_dispatches=10),
    ),  # fmt: skip
    # speculative decoding (schema/rules_draft.py; tests/test_speculative.py breaks real plans)
    (
        "speculative",
        "envelope parts without a draft",
        lambda p: nested(p, "envelope", parts=[EnvelopePart("target", 256, 256, 0, 128)]),
    ),  # fmt: skip
    (
        "speculative",
        "a verify phase without a draft",
        lambda p: replace(p, phases=[P0(p), replace(P0(p), name="verify")]),
    ),  # fmt: skip
    # vision-language plans (schema/rules_vision.py; tests/test_vision.py breaks real plans)
    (
        "vision",
        "a vision phase without a vision section",
        lambda p: replace(p, phases=[P0(p), replace(P0(p), name="vision")]),
    ),  # fmt: skip
    # a rank's plan (schema/rules_distributed.py; tests/test_distributed.py breaks real ones)
    (
        "distributed",
        "a collective op in a one-process plan",
        lambda p: op(p, 2, primitive="AllReduce", args=["sum"], inputs=["t1"]),
    ),  # fmt: skip
    ("distributed", "rank beyond the group", lambda p: _ranked(p, rank=2)),
    (
        "distributed",
        "a Send to itself",
        lambda p: op(_ranked(p), 2, primitive="Send", args=[0], inputs=["t1"]),
    ),  # fmt: skip
    (
        "distributed",
        "a pipeline split that does not sum to the layers",
        lambda p: _ranked(p, mode="pipeline", split=[1, 1]),
    ),  # fmt: skip
    (
        "distributed",
        "a tensor rank running part of the layers",
        lambda p: nested(_ranked(p), "model", num_layers=2),
    ),  # fmt: skip
    (
        "distributed",
        "a shard that is not 1/parts of its stored tensor",
        lambda p: _sharded(p, RankShard(stored_shape=[16, 8], axis=0, parts=2, index=1)),
    ),  # fmt: skip
    (
        "distributed",
        "a shard in a plan of one process",
        lambda p: _sharded(
            p, RankShard(stored_shape=[32, 8], axis=0, parts=2, index=1), rank=False
        ),
    ),  # fmt: skip
]


def _ranked(plan: Plan, **changes) -> Plan:
    """The tiny plan (one layer) as rank 0 of a 2-rank tensor-parallel split."""
    fields = dict(mode="tensor", ranks=2, rank=0, layers=[0, 1]) | changes
    return replace(plan, distributed=Distributed(**fields))


def _sharded(plan: Plan, shard: RankShard, rank: bool = True) -> Plan:
    w = plan.model.weights.tensors
    plan = weights(plan, tensors=[replace(w[0], shard=shard), *w[1:]])
    return _ranked(plan) if rank else plan


def test_a_consistent_rank_plan_is_valid(tiny_plan: Plan) -> None:
    good = _sharded(tiny_plan, RankShard(stored_shape=[32, 8], axis=0, parts=2, index=1))
    assert verify_plan(good) == []


def test_a_consistent_lengths_record_is_valid(tiny_plan: Plan) -> None:
    good = [LengthAffine([0], 8, ["o1/0.1"]), LengthAffine([0], 1, ["itok/1"])]
    assert verify_plan(_with_lengths(tiny_plan, affine=good)) == []


def _with_prefill(plan: Plan) -> Plan:
    """A copy of the decode phase named prefill (so the plan is runnable): it lacks last_index and
    processes one token, not the plan's prefill_chunk (4)."""
    return replace(plan, phases=[replace(P0(plan), name="prefill"), P0(plan)])


def _no_dynamic_scratch(plan: Plan) -> Plan:
    plan = op(plan, 3, scratch=0)
    return phase(plan, tensors=[t for t in P0(plan).tensors if t.id != "scratch.3"])


def _ring(plan: Plan, slots: int) -> Plan:
    """The cache declared a sliding-window ring (its writes stay at the plain position)."""
    from dctms.schema.types import SlidingWindow

    state = [replace(s, window=SlidingWindow(window=4, slots=slots)) for s in plan.state]
    return replace(plan, state=state)


def _state_written_at(plan: Plan, index_id: str) -> Plan:
    return op(plan, 3, inputs=["k_in", "t0", index_id])


def test_two_segment_variant_is_valid(tiny_plan: Plan) -> None:
    assert verify_plan(_two_segments(tiny_plan)) == []


def test_a_donated_output_is_valid(tiny_plan: Plan) -> None:
    assert verify_plan(_donated(tiny_plan)) == []


def test_tiny_plan_is_valid(tiny_plan: Plan) -> None:
    assert verify_plan(tiny_plan) == []


def test_a_matching_compile_request_is_valid(tiny_plan: Plan) -> None:
    assert verify_plan(with_request(tiny_plan)) == []
    explicit = dict(prefill_chunk=4, dtype="float16", backend="cpu", alignment=64, profile="test")
    assert verify_plan(with_request(tiny_plan, **explicit)) == []


def test_every_rule_has_a_breaking_case() -> None:
    assert {rule for rule, _, _ in CASES} == set(RULES)


@pytest.mark.parametrize(("rule", "how", "breaker"), CASES, ids=[f"{r}: {h}" for r, h, _ in CASES])
def test_broken_plan_is_reported(rule: str, how: str, breaker: Break) -> None:
    problems = verify_plan(breaker(make_tiny_plan()))
    assert rule in {p.rule for p in problems}, f"{how}: got {[str(p) for p in problems]}"
    for problem in problems:
        assert problem.path.startswith("$") and problem.message and "\n" not in problem.message


def test_problem_paths_point_at_the_field(tiny_plan: Plan) -> None:
    # tensors: t0, t1, t2, k_out, scratch.3, t3, out
    problems = verify_plan(tensor(tiny_plan, "t3", interval=[3, 9]))
    assert [p.path for p in problems if p.rule == "interval_bounds"] == [
        "$.phases[0].tensors[5].interval"
    ]
    # t2 at offset 0 collides with t0 (both live in slot 2) and then with t3 (slot 3).
    problems = verify_plan(tensor(tiny_plan, "t2", offset=0))
    overlap = [p for p in problems if p.rule == "arena_overlap"]
    assert [p.path for p in overlap] == ["$.phases[0].tensors[2]", "$.phases[0].tensors[5]"]
    assert "'t0'" in overlap[0].message and "'t2'" in overlap[1].message


def test_scratch_and_sync_messages_name_the_field(tiny_plan: Plan) -> None:
    problems = verify_plan(op(tiny_plan, 3, scratch=16))
    assert [(p.path, p.message) for p in problems] == [
        ("$.phases[0].tensors[4].bytes", "8 bytes, but op 3 declares 16 scratch bytes")
    ]
    problems = verify_plan(phase(tiny_plan, sync_points=[SyncPoint(4, "x", evaluate=["k_out"])]))
    assert [(p.path, p.message) for p in problems] == [
        ("$.phases[0].outputs[0].id", "output 'out' is evaluated at no sync point")
    ]


def test_envelope_provable_is_all_but_runtime(tiny_plan: Plan) -> None:
    # weights 256 + kv 256 + persistent 0 + intermediate 128 = 640 = M_max 1664 - runtime 1024
    env = tiny_plan.envelope
    assert env.provable == 640 == env.total - env.runtime


def test_problems_per_rule_are_capped(tiny_plan: Plan) -> None:
    # 200 copies of one tensor id: 199 duplicates, listed up to the cap plus one summary line.
    many = [replace(P0(tiny_plan).tensors[0]) for _ in range(200)]
    problems = [p for p in verify_plan(phase(tiny_plan, tensors=many)) if p.rule == "unique_ids"]
    assert len(problems) == MAX_PER_RULE + 1
    assert problems[-1].message.startswith("further unique_ids problems")


def test_zero_byte_tenants_never_overlap(tiny_plan: Plan) -> None:
    # A [1, 0] tensor owns no bytes; placing it inside a live neighbour is not a conflict.
    empty = tensor(tiny_plan, "t2", shape=[1, 0], bytes=0, offset=0)
    assert "arena_overlap" not in {p.rule for p in verify_plan(empty)}


def test_a_binding_of_a_fused_weight_has_its_parts_end_to_end(tiny_plan: Plan) -> None:
    plan = fused(tiny_plan, [EMB, "emb2"])
    whole = binding(plan, "inputs", "w_emb", name="fused", shape=[32, 8])
    rules = {p.rule for p in verify_plan(whole)}
    assert not rules & {"bindings", "fused_weights"}
    wrong = binding(plan, "inputs", "w_emb", name="fused", shape=[16, 8])  # one part's shape
    assert "bindings" in {p.rule for p in verify_plan(wrong)}
