"""``dctms show``'s text: bounds, the memory envelope, the paper's Table 1, arena vs lower bound.

The rows are ``dctms.figures.overview``'s (the inspector's Overview draws the same ones).
"""

from __future__ import annotations

from dctms.figures.lengths import grid_steps_text, grid_text
from dctms.figures.overview import (
    PARTS_RULE,
    arena_rows,
    bounds_rows,
    envelope_rows,
    header,
    model_part_rows,
    slack_by_phase,
    speculative_line,
)
from dctms.figures.overview import table1 as table1_figures
from dctms.figures.units import MIB
from dctms.figures.vision import stream_rows
from dctms.schema.types import Plan
from dctms.views.ranks import rank_section


def show_text(plan: Plan) -> str:
    """The summary ``dctms show PLAN`` prints (ends with a newline)."""
    sections = [_header(plan), _bounds(plan), _envelope(plan), _table1(plan), _arena(plan)]
    if plan.draft is not None:
        sections.insert(3, _models(plan))
    ranked = rank_section(plan)
    if ranked is not None:
        sections.insert(1, ranked)
    if any(p.lengths for p in plan.phases):
        sections.append(_lengths(plan))
    if plan.vision is not None:
        sections.append(_vision(plan))
    return "\n\n".join(sections) + "\n"


def _header(plan: Plan) -> str:
    h = header(plan)
    model = plan.target.memory_model
    target = h.backend if model is None else f"{model.name} ({h.backend} backend,"
    text = (
        f"plan: {h.architecture}, {h.num_layers} layers, {h.weight_tensors} weight tensors, "
        f"target {target}{' (' if model is None else ' '}alignment {h.alignment})\n"
        f"schema v{h.schema_version}; compiled by {h.generator}"
    )
    fused = fused_kernels_text(plan)
    text = text if not fused else text + "\n" + fused
    return text if model is None else text + "\n" + memory_model_text(plan)


FAST = ("RMSNorm", "RoPE", "ScaledDotProductAttention")


def fused_kernels_text(plan: Plan) -> str:
    """How many ops are MLX's fused kernels, and what their scratch is charged from."""
    n = sum(1 for p in plan.phases for o in p.ops if o.primitive in FAST)
    if not n:
        return ""
    model = plan.target.memory_model
    how = (
        "the composite MLX's CPU runs for it (all its intermediates at once)"
        if model is None
        else f"MLX's {model.name} kernel source, not measured"
    )
    return f"fused kernels: {n} mx.fast ops, each charged its scratch from {how}"


def memory_model_text(plan: Plan) -> str:
    """A GPU target's allocator model, said plainly to be modelled from source, not measured."""
    m = plan.target.memory_model
    assert m is not None
    lines = [
        f"memory model: {m.name}, modelled from MLX {m.mlx}'s allocator source, not measured "
        f"(pages of {m.page_bytes:,} B; command buffers of {m.ops_per_buffer} kernel ops, "
        f"{m.active_tasks} outstanding: lifetimes widened by {plan.target.run_ahead_dispatches} "
        "kernel ops)"
    ]
    lines += [f"  not modelled: {what}" for what in m.not_modelled]
    return "\n".join(lines)


def _bounds(plan: Plan) -> str:
    return "bounds\n" + "\n".join(f"  {name:<20} {value}" for name, value in bounds_rows(plan))


def _envelope(plan: Plan) -> str:
    lines = [f"{'memory envelope':<20} {'bytes':>18} {'MiB':>12}"]
    for row in envelope_rows(plan):
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"  {row.name:<18} {row.bytes:>18,} {row.bytes / MIB:>12.2f}{note}")
    return "\n".join(lines)


def _models(plan: Plan) -> str:
    """The envelope's parts per model (speculative plans)."""
    lines = [
        speculative_line(plan),
        f"  {'model':<8} {'architecture':<14} {'layers':>6} {'weights':>14} {'kv':>12} "
        f"{'persistent':>11} {'intermediate':>13} {'provable peak MiB':>18}",
    ]
    for r in model_part_rows(plan):
        arch = r.architecture if r.model != "plan" else "sum; max"
        layers = str(r.num_layers) if r.model != "plan" else ""
        lines.append(
            f"  {r.model:<8} {arch:<14} {layers:>6} {r.weights:>14,} {r.kv:>12,} "
            f"{r.persistent:>11,} {r.intermediate:>13,} {r.provable / MIB:>18.2f}"
        )
    lines.append(f"  ({PARTS_RULE})")
    return "\n".join(lines)


def _table1(plan: Plan) -> str:
    t = table1_figures(plan)
    return "\n".join(
        [
            f"{'Table 1: interval colouring':<28} {'this plan':>10} {'paper':>8}",
            f"  {'logical tensors':<26} {t.logical_tensors:>10,} {t.paper_logical:>8}",
            f"  {'physical buffers':<26} {t.physical_buffers:>10,} {t.paper_physical:>8}",
            f"  {'reduction':<26} {t.reduction:>10.2%} {t.paper_reduction:>8.2%}",
        ]
    )


def _arena(plan: Plan) -> str:
    lines = [f"{'arena vs lower bound':<28} {'arena':>16} {'lower bound':>16} {'ratio':>7}"]
    for row in arena_rows(plan):
        ratio = "n/a" if row.ratio is None else f"{row.ratio:.3f}"
        lines.append(f"  {row.name:<26} {row.arena:>16,} {row.lower_bound:>16,} {ratio:>7}")
    slack = slack_by_phase(plan)
    if slack:
        text = ", ".join(f"{name} {size:,}" for name, size in slack)
        lines.append(f"  allocator cache-reuse slack (in M_intermediate): {text} bytes")
    return "\n".join(lines)


def _lengths(plan: Plan) -> str:
    """The real-length phases: what varies up to which bound, and how many points were verified."""
    lines = ["real-length phases (planned at the bound, run at the smallest verified point)"]
    for p in plan.phases:
        if p.lengths is None:
            lines.append(f"  {p.name:<10} fixed: every call padded to the planned shapes")
            continue
        varies = ", ".join(
            f"{n} <= {b}" for n, b in zip(p.lengths.names, p.lengths.bound, strict=True)
        )
        places = sum(len(f.at) for f in p.lengths.affine)
        lines.append(
            f"  {p.name:<10} {varies}; {len(p.lengths.points)} verified points, "
            f"{places} arguments follow the lengths"
        )
        lines.append(f"  {'':<10} grid: {grid_text(p)}")
    lines.append(f"  grid steps: {grid_steps_text(plan)}")
    return "\n".join(lines)


def _vision(plan: Plan) -> str:
    """A vision-language plan's image bounds and its streams."""
    v = plan.vision
    sizes = f"{len(v.variants)} size(s) up to {v.image_size[0]}x{v.image_size[1]}"
    lines = [
        f"vision-language ({v.family}, {v.resolution} resolution): at most {v.images} images, "
        f"{sizes}, at most {v.tokens_per_image} tokens each; features table {v.feature_rows} x "
        f"{v.hidden_size}",
        "  streams: "
        + ("overlapped (one call of each at once)" if v.overlap else "taking turns (serial)"),
    ]
    for row in stream_rows(plan):
        phases = ", ".join(row.phases) if len(row.phases) <= 4 else (
            f"{row.phases[0]} ... {row.phases[-1]} ({len(row.phases)} phases)"
        )
        call = f"; largest call {row.largest_call:,} bytes" if row.largest_call else ""
        lines.append(f"  {row.name:<8} MLX stream {row.mlx_stream}: {phases}{call}")
    return "\n".join(lines)
