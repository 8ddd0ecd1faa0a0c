"""Verifier rules about plan-wide figures: bounds, bindings, state, weights, envelope, stats."""

from __future__ import annotations

import math
from collections.abc import Iterator

from dctms.schema.fingerprint import layout_sha256
from dctms.schema.fused import fused_problems, fused_tensors
from dctms.schema.phase_index import PlanIndex
from dctms.schema.sizes import is_arena_tenant
from dctms.schema.vision_bytes import intermediate_need

Finding = tuple[str, str]

STATE_KINDS = ("kv", "persistent")
INPUT_KINDS = ("input", "weight", "state")
OUTPUT_KINDS = ("output", "state")


def bounds(ix: PlanIndex) -> Iterator[Finding]:
    """N, M, batch and chunk are >= 1 and the static cache holds N + M and the padded last chunk."""
    b = ix.plan.bounds
    for name in ("input_tokens", "output_tokens", "batch", "prefill_chunk"):
        if getattr(b, name) < 1:
            yield f"$.bounds.{name}", f"must be >= 1, got {getattr(b, name)}"
    if b.kv_capacity < b.input_tokens + b.output_tokens:
        yield (
            "$.bounds.kv_capacity",
            (
                f"{b.kv_capacity} positions cannot hold input_tokens + output_tokens "
                f"({b.input_tokens} + {b.output_tokens})"
            ),
        )
    if b.prefill_chunk >= 1:
        padded = math.ceil(b.input_tokens / b.prefill_chunk) * b.prefill_chunk
        if b.kv_capacity < padded:
            yield (
                "$.bounds.kv_capacity",
                (
                    f"{b.kv_capacity} positions cannot hold the padded prompt "
                    f"({padded} = input_tokens rounded up to prefill_chunk {b.prefill_chunk})"
                ),
            )
    if (b.kv.bits is None) != (b.kv.group_size is None):
        yield "$.bounds.kv", "a quantised KV cache needs both bits and group_size"
    for k, phase in enumerate(ix.plan.phases):
        if phase.tokens < 1:
            yield f"$.phases[{k}].tokens", f"must be >= 1, got {phase.tokens}"


def state_kind(ix: PlanIndex) -> Iterator[Finding]:
    """State is either KV cache or other persistent memory (the envelope counts them apart)."""
    for i, s in enumerate(ix.plan.state):
        if s.kind not in STATE_KINDS:
            yield (
                f"$.state[{i}].kind",
                f"unknown state kind {s.kind!r} (expected one of {STATE_KINDS})",
            )


def weights_fingerprint(ix: PlanIndex) -> Iterator[Finding]:
    """The weights fingerprint's count, total and layout hash match its tensor list."""
    w = ix.plan.model.weights
    if w.count != len(w.tensors):
        yield "$.model.weights.count", f"count {w.count}, but {len(w.tensors)} tensors are listed"
    total = sum(t.bytes for t in w.tensors)
    if w.total_bytes != total:
        yield (
            "$.model.weights.total_bytes",
            f"{w.total_bytes}, but the listed tensors add up to {total}",
        )
    layout = layout_sha256([(t.name, t.shape, t.dtype) for t in w.tensors])
    if w.layout_sha256 != layout:
        yield (
            "$.model.weights.layout_sha256",
            "does not match the listed tensors' names, shapes and dtypes",
        )


def bindings(ix: PlanIndex) -> Iterator[Finding]:
    """Bindings have the right direction and match what they name: weights, state, output tensors."""
    plan = ix.plan
    weights = {w.name: w for w in plan.model.weights.tensors}
    weights.update(fused_tensors(plan.model.weights))  # bound whole, never by their parts
    state = {s.name: s for s in plan.state}
    for px in ix.phases:
        for field, allowed in (("inputs", INPUT_KINDS), ("outputs", OUTPUT_KINDS)):
            for k, b in enumerate(getattr(px.phase, field)):
                where = f"{px.path}.{field}[{k}]"
                if b.kind not in allowed:
                    yield f"{where}.kind", f"a phase {field[:-1]} cannot be of kind {b.kind!r}"
                    continue
                target = {"weight": weights, "state": state}.get(b.kind)
                if target is not None:
                    named = target.get(b.name)
                    if named is None:
                        yield f"{where}.name", f"no {b.kind} named {b.name!r} in the plan"
                    elif (named.shape, named.dtype) != (b.shape, b.dtype):
                        yield (
                            where,
                            (
                                f"{b.kind} {b.name!r} is {named.shape} {named.dtype}, "
                                f"binding says {b.shape} {b.dtype}"
                            ),
                        )
                if field == "outputs" and b.id in px.tensor_at:
                    tensor = px.phase.tensors[px.tensor_at[b.id]]
                    if (tensor.shape, tensor.dtype) != (b.shape, b.dtype):
                        yield (
                            where,
                            (
                                f"tensor {b.id!r} is {tensor.shape} {tensor.dtype}, binding says {b.shape} {b.dtype}"
                            ),
                        )
                    # a recurrent state is a fresh array every call: an arena tenant until the end
                    fresh = b.kind == "state" and tensor.kind == "output"
                    if tensor.kind != b.kind and not (fresh and _recurrent(state.get(b.name))):
                        yield where, f"binds tensor {b.id!r} of kind {tensor.kind!r} as {b.kind!r}"
        bound = {b.id for b in px.phase.outputs}
        for i, t in enumerate(px.phase.tensors):
            if t.kind in OUTPUT_KINDS and t.id not in bound:
                yield (
                    f"{px.tensor_path(i)}.kind",
                    f"a tensor of kind {t.kind!r} must be named in the phase outputs",
                )


def fused_weights(ix: PlanIndex) -> Iterator[Finding]:
    """Every fused weight is two or more weights end to end along axis 0 (one dtype, the same
    trailing dimensions, no part in two), and no phase binds one of its parts on its own: the
    runner keeps the fused view only."""
    weights = ix.plan.model.weights
    yield from fused_problems(weights)
    part_of = {p: fw.name for fw in weights.fused for p in fw.parts}
    for px in ix.phases:
        for k, b in enumerate(px.phase.inputs):
            if b.kind == "weight" and b.name in part_of:
                yield (
                    f"{px.path}.inputs[{k}].name",
                    f"binds {b.name!r}, a part of the fused weight {part_of[b.name]!r}",
                )


def _recurrent(state) -> bool:
    return state is not None and state.recurrent


def envelope_sum(ix: PlanIndex) -> Iterator[Finding]:
    """M_max is the sum of its parts, and each part matches the plan it summarises."""
    plan, env = ix.plan, ix.plan.envelope
    parts = env.weights + env.kv + env.persistent + env.intermediate + env.runtime
    if env.total != parts:
        yield (
            "$.envelope.total",
            f"{env.total}, but weights+kv+persistent+intermediate+runtime = {parts}",
        )
    # The plan's own model (the target, in a plan with a draft) against its figures: the envelope
    # itself, or its "target" part; the parts' combination is checked by _parts_combine.
    own, where = env, "$.envelope"
    if env.parts:
        yield from _parts_combine(env)
        own = next((p for p in env.parts if p.model == "target"), None)
        where = f"$.envelope.parts[{env.parts.index(own)}]" if own is not None else ""
    if own is None:
        return
    # Vision-language plans: a vision call's own inputs (pixel values) live only during the call
    # and count with its arena; overlapped streams add one call of each (schema.vision_bytes).
    largest = intermediate_need(plan)
    if own.intermediate != largest:
        what = "the largest phase arena plus allocator slack"
        if plan.vision is not None:
            what += " (a vision call's inputs with its arena; overlapped: text + vision)"
        yield f"{where}.intermediate", f"{own.intermediate}, but {what} is {largest}"
    for name in STATE_KINDS:
        total = sum(s.bytes for s in plan.state if s.kind == name)
        if getattr(own, name) != total:
            yield (
                f"{where}.{name}",
                f"{getattr(own, name)}, but the {name} state adds up to {total}",
            )
    if own.weights != plan.model.weights.total_bytes:
        yield (
            f"{where}.weights",
            f"{own.weights}, but the model's weights total {plan.model.weights.total_bytes}",
        )
    if env.device != plan.target.device_memory:
        yield (
            "$.envelope.device",
            f"{_or_absent(env.device)}, but the target's device_memory is "
            f"{_or_absent(plan.target.device_memory)}",
        )
    if env.device is None:
        if env.free is not None:
            yield "$.envelope.free", "free is given without a device size"
    elif env.free != env.device - env.total:
        yield "$.envelope.free", f"{env.free}, but device - total = {env.device - env.total}"


def _parts_combine(env) -> Iterator[Finding]:
    """Both models stay resident (weights, kv, persistent add up); their calls never overlap (the
    intermediate is the larger arena)."""
    for name in ("weights", "kv", "persistent"):
        total = sum(getattr(p, name) for p in env.parts)
        if getattr(env, name) != total:
            yield f"$.envelope.{name}", f"{getattr(env, name)}, but its parts add up to {total}"
    largest = max(p.intermediate for p in env.parts)
    if env.intermediate != largest:
        yield (
            "$.envelope.intermediate",
            f"{env.intermediate}, but the largest part's intermediate is {largest}",
        )


def stats(ix: PlanIndex) -> Iterator[Finding]:
    """Table 1 figures and the arena summary are recomputed from the phases."""
    plan, st = ix.plan, ix.plan.stats
    logical = sum(1 for p in plan.phases for t in p.tensors if is_arena_tenant(t))
    physical = sum(len(p.buffers) for p in plan.phases)
    if st.logical_tensors != logical:
        yield (
            "$.stats.logical_tensors",
            f"{st.logical_tensors}, but the phases have {logical} arena tensors",
        )
    if st.physical_buffers != physical:
        yield (
            "$.stats.physical_buffers",
            f"{st.physical_buffers}, but the phases have {physical} buffers",
        )
    reduction = 1 - st.physical_buffers / st.logical_tensors if st.logical_tensors else 0.0
    if not abs(st.reduction - reduction) <= 1e-9:
        yield "$.stats.reduction", f"{st.reduction}, but 1 - physical/logical = {reduction}"
    arena = max((p.arena_bytes for p in plan.phases), default=0)
    if st.arena_bytes != arena:
        yield "$.stats.arena_bytes", f"{st.arena_bytes}, but the largest phase arena is {arena}"
    bound = max((p.lower_bound_bytes for p in plan.phases), default=0)
    if st.lower_bound_bytes != bound:
        yield (
            "$.stats.lower_bound_bytes",
            f"{st.lower_bound_bytes}, but the largest phase lower bound is {bound}",
        )


def _or_absent(value: int | None) -> str:
    return "absent" if value is None else str(value)
