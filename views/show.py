"""``dctms show``'s text: bounds, the memory envelope, the paper's Table 1, arena vs lower bound."""

from __future__ import annotations

from dctms.schema.types import Plan

# The paper's Table 1 (logical tensors -> physical buffers), printed for comparison.
PAPER_LOGICAL = 448
PAPER_PHYSICAL = 122
PAPER_REDUCTION = 1 - PAPER_PHYSICAL / PAPER_LOGICAL  # 72.77%

MIB = 2**20


def show_text(plan: Plan) -> str:
    """The summary ``dctms show PLAN`` prints (ends with a newline)."""
    sections = [_header(plan), _bounds(plan), _envelope(plan), _table1(plan), _arena(plan)]
    if any(p.lengths for p in plan.phases):
        sections.append(_lengths(plan))
    return "\n\n".join(sections) + "\n"


def _header(plan: Plan) -> str:
    g, m, t = plan.generator, plan.model, plan.target
    return (
        f"plan: {m.architecture}, {m.num_layers} layers, {m.weights.count} weight tensors, "
        f"target {t.backend} (alignment {t.alignment})\n"
        f"schema v{plan.schema_version}; compiled by dctms {g.dctms}, mlx {g.mlx}, mlx-lm {g.mlx_lm}"
    )


def _bounds(plan: Plan) -> str:
    b = plan.bounds
    kv = b.kv.dtype
    if b.kv.bits is not None:
        kv += f", {b.kv.bits}-bit, groups of {b.kv.group_size}"
    rows = [
        ("input tokens (N)", b.input_tokens),
        ("output tokens (M)", b.output_tokens),
        ("batch", b.batch),
        ("prefill chunk", b.prefill_chunk),
        ("dtype", b.dtype),
        ("KV cache", f"{kv}, capacity {b.kv_capacity} positions"),
    ]
    return "bounds\n" + "\n".join(f"  {name:<20} {value}" for name, value in rows)


def _envelope(plan: Plan) -> str:
    e = plan.envelope
    rows = [
        ("weights", e.weights, ""),
        ("kv", e.kv, ""),
        ("persistent", e.persistent, ""),
        ("intermediate", e.intermediate, ""),
        ("runtime", e.runtime, f"  ({e.runtime_source})" if e.runtime_source else ""),
        ("total = M_max", e.total, ""),
    ]
    if e.device is not None:
        rows.append(("device", e.device, ""))
    if e.free is not None:
        rows.append(("free", e.free, "  (does not fit)" if e.free < 0 else ""))
    lines = [f"{'memory envelope':<20} {'bytes':>18} {'MiB':>12}"]
    lines += [f"  {name:<18} {value:>18,} {value / MIB:>12.2f}{note}" for name, value, note in rows]
    return "\n".join(lines)


def _table1(plan: Plan) -> str:
    s = plan.stats
    return "\n".join(
        [
            f"{'Table 1: interval colouring':<28} {'this plan':>10} {'paper':>8}",
            f"  {'logical tensors':<26} {s.logical_tensors:>10,} {PAPER_LOGICAL:>8}",
            f"  {'physical buffers':<26} {s.physical_buffers:>10,} {PAPER_PHYSICAL:>8}",
            f"  {'reduction':<26} {s.reduction:>10.2%} {PAPER_REDUCTION:>8.2%}",
        ]
    )


def _arena(plan: Plan) -> str:
    rows = [(p.name, p.arena_bytes, p.lower_bound_bytes) for p in plan.phases]
    rows.append(("max over phases", plan.stats.arena_bytes, plan.stats.lower_bound_bytes))
    lines = [f"{'arena vs lower bound':<28} {'arena':>16} {'lower bound':>16} {'ratio':>7}"]
    for name, arena, bound in rows:
        ratio = f"{arena / bound:.3f}" if bound else "n/a"
        lines.append(f"  {name:<26} {arena:>16,} {bound:>16,} {ratio:>7}")
    if any(p.slack_bytes for p in plan.phases):
        slack = ", ".join(f"{p.name} {p.slack_bytes:,}" for p in plan.phases)
        lines.append(f"  allocator cache-reuse slack (in M_intermediate): {slack} bytes")
    return "\n".join(lines)


def _lengths(plan: Plan) -> str:
    """The real-length phases: what varies up to which bound, and how many points were verified."""
    lines = ["real-length phases (planned at the bound, run at the smallest verified point)"]
    for p in plan.phases:
        if p.lengths is None:
            lines.append(f"  {p.name:<10} fixed: every call padded to the planned shapes")
            continue
        varies = ", ".join(f"{n} <= {b}" for n, b in zip(p.lengths.names, p.lengths.bound, strict=True))
        places = sum(len(f.at) for f in p.lengths.affine)
        lines.append(
            f"  {p.name:<10} {varies}; {len(p.lengths.points)} verified points, "
            f"{places} arguments follow the lengths"
        )
    return "\n".join(lines)
