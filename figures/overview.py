"""A plan at a glance: header, bounds, the memory envelope, the paper's Table 1, arena vs bound.

``dctms show`` (``views.show``) lays these rows out as text; the inspector's Overview as tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from dctms.figures.cache_layout import cache_rows
from dctms.figures.ranks import rank_label
from dctms.schema.types import Plan

# The paper's Table 1 (logical tensors -> physical buffers), shown for comparison.
PAPER_LOGICAL = 448
PAPER_PHYSICAL = 122
PAPER_REDUCTION = 1 - PAPER_PHYSICAL / PAPER_LOGICAL  # 72.77%

# The components of M_max, in stacking order.
COMPONENTS = ("weights", "kv", "persistent", "intermediate", "runtime")


@dataclass(frozen=True)
class Header:
    """Which model and target the plan is for, and what wrote it."""

    architecture: str
    num_layers: int
    weight_tensors: int
    backend: str
    alignment: int
    schema_version: int
    generator: str  # "dctms 0.1.0, mlx 0.32.0, mlx-lm 0.32.0"


def header(plan: Plan) -> Header:
    m, g, t = plan.model, plan.generator, plan.target
    return Header(
        m.architecture,
        m.num_layers,
        m.weights.count,
        t.backend,
        t.alignment,
        plan.schema_version,
        f"dctms {g.dctms}, mlx {g.mlx}, mlx-lm {g.mlx_lm}",
    )


def kv_storage(plan: Plan) -> str:
    """``bfloat16``, ``bfloat16, 4-bit, groups of 64`` or ``..., quantised from position 40``."""
    kv = plan.bounds.kv
    if kv.bits is None:
        return kv.dtype
    start = f", quantised from position {kv.quantized_start}" if kv.quantized_start else ""
    return f"{kv.dtype}, {kv.bits}-bit, groups of {kv.group_size}{start}"


def bounds_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, value) for N, M, batch, prefill chunk, dtype and the KV cache."""
    b = plan.bounds
    return [
        ("input tokens (N)", str(b.input_tokens)),
        ("output tokens (M)", str(b.output_tokens)),
        ("batch", batch_label(plan)),
        ("prefill chunk", str(b.prefill_chunk)),
        ("dtype", b.dtype),
        ("KV cache", f"{kv_storage(plan)}, capacity {b.kv_capacity} positions"),
        ("spare position", spare_position(plan)),
        *([("prefix pool", pool_label(plan))] if b.prefix_blocks else []),
        *cache_rows(plan),
    ] + ([("rank", rank_label(plan))] if plan.distributed is not None else [])


def spare_position(plan: Plan) -> str:
    """Why the KV cache holds one position beyond N + M, and what it costs."""
    b, e = plan.bounds, plan.envelope
    cost = (e.kv - pool_bytes(plan)) // b.kv_capacity if b.kv_capacity else 0
    why = (
        "attention reads a proper slice of the cache at every window (MLX makes no Slice for a "
        "full-range one, so the graph would differ at the largest window)"
    )
    if b.batch > 1:
        why += "; a decode row without a sequence writes there, where no window reaches"
    extra = b.kv_capacity - b.input_tokens - b.output_tokens
    if extra > 1:  # kv_capacity: the padded prompt (longer than N + M) plus the spare
        why += f"; the other {extra - 1} hold the last prompt chunk's padding"
    return f"{extra} beyond N + M, {cost:,} B each: {why}"


def batch_label(plan: Plan) -> str:
    """``1``, or a batched plan's slots: ``8 slots of 321 positions (one sequence each, ragged
    positions; decode steps of 2 to 8 rows)``."""
    b = plan.bounds
    if b.batch == 1:
        return "1"
    decode = next((p for p in plan.phases if p.name == "decode"), None)
    rows = ""
    if decode is not None and decode.lengths is not None and "rows" in decode.lengths.names:
        d = decode.lengths.names.index("rows")
        counts = sorted({p[d] for p in decode.lengths.points})
        rows = f"; decode steps of {counts[0]} to {counts[-1]} rows"
    return (
        f"{b.batch} slots of {b.kv_capacity} positions (one sequence each, ragged positions"
        f"{rows})"
    )


def pool_bytes(plan: Plan) -> int:
    """Bytes of the prompt-prefix pool's blocks (``toolkit.prefix_pool``), 0 without one."""
    return sum(s.bytes for s in plan.state if s.name.endswith(".pool"))


def pool_label(plan: Plan) -> str:
    """``64 blocks of 256 positions (1,572,864 B each, 100,663,296 B in M_KV); LRU``."""
    k, pool = plan.bounds.prefix_blocks, pool_bytes(plan)
    return (
        f"{k} blocks of {plan.bounds.prefill_chunk} positions ({pool // k:,} B each, {pool:,} B "
        "in M_KV): earlier prompts' whole chunks, kept across requests, least recently used "
        "evicted"
    )


def kv_per_slot(plan: Plan) -> str:
    """The KV line's note: what one slot costs (a batched plan), and the prefix pool's share."""
    b, pool = plan.bounds.batch, pool_bytes(plan)
    slots = plan.envelope.kv - pool
    parts = [f"{b} slots x {slots // b:,} B"] if b > 1 else []
    if pool:
        parts.append(f"prefix pool {pool:,} B")
    return "; ".join(parts)


@dataclass(frozen=True)
class EnvelopeRow:
    name: str
    bytes: int
    note: str = ""  # where the figure comes from, or a warning


def envelope_parts(plan: Plan) -> list[tuple[str, int]]:
    """The components of M_max in stacking order, with their bytes."""
    e = plan.envelope
    return [(name, getattr(e, name)) for name in COMPONENTS]


def envelope_rows(plan: Plan) -> list[EnvelopeRow]:
    """The components, M_max, and the device budget and what is left when the plan has one."""
    e = plan.envelope
    rows = [EnvelopeRow(name, value) for name, value in envelope_parts(plan)]
    rows = [EnvelopeRow(r.name, r.bytes, kv_per_slot(plan)) if r.name == "kv" else r for r in rows]
    rows[-1] = EnvelopeRow("runtime", e.runtime, e.runtime_source)
    rows.append(EnvelopeRow("total = M_max", e.total))
    if e.device is not None:
        rows.append(EnvelopeRow("device", e.device))
    if e.free is not None:
        rows.append(EnvelopeRow("free", e.free, "does not fit" if e.free < 0 else ""))
    return rows


@dataclass(frozen=True)
class Table1:
    """The paper's Table 1 (interval colouring) for this plan, next to the paper's own figures."""

    logical_tensors: int
    physical_buffers: int
    reduction: float
    paper_logical: int = PAPER_LOGICAL
    paper_physical: int = PAPER_PHYSICAL
    paper_reduction: float = PAPER_REDUCTION


def table1(plan: Plan) -> Table1:
    s = plan.stats
    return Table1(s.logical_tensors, s.physical_buffers, s.reduction)


@dataclass(frozen=True)
class ArenaRow:
    name: str
    arena: int
    lower_bound: int

    @property
    def ratio(self) -> float | None:
        return self.arena / self.lower_bound if self.lower_bound else None


def arena_rows(plan: Plan) -> list[ArenaRow]:
    """Each phase's arena against its lower bound, then the maximum over phases (``stats``); with a
    draft model, its phases and their maximum after the target's."""
    rows = [ArenaRow(p.name, p.arena_bytes, p.lower_bound_bytes) for p in plan.phases]
    rows.append(ArenaRow("max over phases", plan.stats.arena_bytes, plan.stats.lower_bound_bytes))
    if plan.draft is not None:
        d = plan.draft
        rows += [ArenaRow(f"draft {p.name}", p.arena_bytes, p.lower_bound_bytes) for p in d.phases]
        rows.append(ArenaRow("draft: max", d.stats.arena_bytes, d.stats.lower_bound_bytes))
    return rows


@dataclass(frozen=True)
class ModelPartRow:
    """One model's share of a speculative plan's envelope (``Envelope.parts``), or the plan's
    combination of them (``model`` "plan": weights, KV, persistent summed; intermediate the max)."""

    model: str
    architecture: str
    num_layers: int
    weights: int
    kv: int
    persistent: int
    intermediate: int

    @property
    def provable(self) -> int:
        return self.weights + self.kv + self.persistent + self.intermediate


# Why the plan's figures combine the parts as they do (shown under the parts table).
PARTS_RULE = (
    "weights, KV cache and persistent state of both models stay resident and add up; the runner "
    "finishes one model's call before it starts the other's, so one arena is live at a time and "
    "intermediate is the larger one"
)


def model_part_rows(plan: Plan) -> list[ModelPartRow]:
    """Target, draft and their combination (empty for a plan of one model)."""
    if plan.draft is None or not plan.envelope.parts:
        return []
    models = {"target": plan.model, "draft": plan.draft.model}
    rows = [
        ModelPartRow(
            p.model,
            models[p.model].architecture,
            models[p.model].num_layers,
            p.weights,
            p.kv,
            p.persistent,
            p.intermediate,
        )
        for p in plan.envelope.parts
    ]
    e = plan.envelope
    rows.append(ModelPartRow("plan", "", 0, e.weights, e.kv, e.persistent, e.intermediate))
    return rows


def speculative_line(plan: Plan) -> str:
    """``draft proposes K = 3 tokens per verify call of 4`` (empty without a draft)."""
    if plan.draft is None:
        return ""
    k = plan.draft.num_draft
    return f"speculative decoding: the draft proposes K = {k} tokens per verify call of {k + 1}"


def slack_by_phase(plan: Plan) -> list[tuple[str, int]]:
    """Allocator cache-reuse slack per phase (inside M_intermediate); empty when there is none."""
    if not any(p.slack_bytes for p in plan.phases):
        return []
    return [(p.name, p.slack_bytes) for p in plan.phases]
