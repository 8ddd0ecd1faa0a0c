"""Graphviz views of one phase of a plan (pure: ``Plan`` in, ``graphviz.Digraph`` out).

* ``lifetimes``: every arena tenant as a bar on a time axis measured in schedule slots, one row per
  physical buffer (tenants of one buffer never overlap in time, so a row never overlaps itself).
* ``buffers``: the interval colouring: each physical buffer with the tensors that reuse it.
* ``graph``: the op graph, clustered by decoder layer and inside it by the module that made each op
  (``Phase.modules``; ops outside the layers form the "model" cluster), edges labelled with the
  shape that flows along them. Large selections are collapsed to one node per layer: a flat 3,000-op
  graph is unreadable and took Graphviz about two CPU-minutes to lay out.

Only the op graph draws edges between ops; weights and constants are never drawn (700 weight nodes
would bury the structure), per-call inputs and the KV cache are. Labels break lines with Graphviz's
own ``\\n`` escape, so every statement of a .dot file stays on one line (greppable, diffable).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import graphviz

from dctms.figures.units import human
from dctms.schema.errors import DctmsError
from dctms.schema.modules import op_layers, op_modules
from dctms.schema.numbered import NumberedOp, numbered_ops
from dctms.schema.phase_index import build_index
from dctms.schema.sizes import is_arena_tenant
from dctms.schema.types import Phase, Plan, Tensor

VIEWS = ("lifetimes", "buffers", "graph")
FLAT_LIMIT = 400  # ops: larger selections of the graph view collapse to layers unless --flat

Layers = tuple[int, int]  # inclusive range of decoder layers

_DTYPE_SHORT = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
}
_KIND_COLOUR = {"intermediate": "#9ecae1", "output": "#a1d99b", "scratch": "#fdae6b"}
_FONT = "Helvetica"


def peak_phase(plan: Plan) -> Phase:
    """The phase with the peak: the one whose arena (with its slack) is M_intermediate."""
    return max(plan.phases, key=lambda p: (p.arena_bytes + p.slack_bytes, p.name == "prefill"))


def select_phase(plan: Plan, name: str | None) -> Phase:
    """The phase called ``name`` (None: ``peak_phase``); a ``DctmsError`` naming the phases the
    plan has otherwise."""
    if name is None:
        return peak_phase(plan)
    for phase in plan.phases:
        if phase.name == name:
            return phase
    names = ", ".join(p.name for p in plan.phases)
    raise DctmsError(f"plan has no phase {name!r} (phases: {names})")


def shape_text(shape: list[int], dtype: str) -> str:
    """``[1,1,3584] bf16``: compact enough for an edge label."""
    return f"[{','.join(map(str, shape))}] {_DTYPE_SHORT.get(dtype, dtype)}"


def layer_name(layer: int | None) -> str:
    return "model" if layer is None else f"layer {layer}"


def in_range(layer: int | None, layers: Layers | None) -> bool:
    """Whether an op of ``layer`` is selected; with a range, model-level ops are left out."""
    if layers is None:
        return True
    return layer is not None and layers[0] <= layer <= layers[1]


def tensor_layers(plan: Plan, phase: Phase) -> dict[str, int | None]:
    """Tensor id -> decoder layer of the op that writes it (scratch tensors: the op they serve)."""
    index = build_index(phase, "$")
    of_op = op_layers(plan, phase)
    return {tid: of_op[pos] for tid, pos in index.producer.items()}


def tensor_modules(plan: Plan, phase: Phase) -> dict[str, str | None]:
    """Tensor id -> module path of the op that writes it (scratch tensors: the op they serve)."""
    index = build_index(phase, "$")
    of_op = op_modules(plan, phase)
    return {tid: of_op[pos] for tid, pos in index.producer.items()}


def bar_label(module: str | None, tensor_id: str) -> str:
    """A lifetime bar's label: the module path below the model (``layers.26.self_attn``), else
    the tensor id."""
    if not module:
        return tensor_id
    return module.removeprefix("model.")


def _tenants(plan: Plan, phase: Phase, layers: Layers | None) -> list[Tensor]:
    of_layer = tensor_layers(plan, phase)
    return [t for t in phase.tensors if is_arena_tenant(t) and in_range(of_layer.get(t.id), layers)]


def _title(plan: Plan, phase: Phase, what: str, layers: Layers | None) -> str:
    m, b = plan.model, plan.bounds
    where = f", layers {layers[0]}-{layers[1]}" if layers else ""
    return (
        f"{m.architecture} {m.num_layers} layers, N={b.input_tokens} M={b.output_tokens}: "
        f"{phase.name} phase{where}: {what}"
    )


def _tooltip(t: Tensor, module: str | None = None) -> str:
    return (
        f"{t.id}{f' ({module})' if module else ''} {shape_text(t.shape, t.dtype)} {t.kind}, "
        f"{t.bytes:,} B, "
        f"slots {t.interval[0]}-{t.interval[1]}, buffer {t.buffer}, offset {t.offset}"
    )


# ------------------------------------------------------------------------------------- lifetimes


def lifetimes_graph(plan: Plan, phase: Phase, layers: Layers | None = None) -> graphviz.Digraph:
    """Arena tenants as bars on a slot axis, one row per physical buffer (neato, pinned positions)."""
    tenants = _tenants(plan, phase, layers)
    if not tenants:
        raise DctmsError(f"{phase.name}: no arena tenants in the selection")
    first = min(t.interval[0] for t in tenants)
    last = max(t.interval[1] for t in tenants)
    span = last - first + 1
    per_slot = min(0.05, 40.0 / span)  # inches per slot: at most ~40 in wide
    row_h, bar_h = 0.3, 0.22
    rows = sorted({t.buffer for t in tenants}, key=lambda b: (b is None, b))
    row_of = {b: i for i, b in enumerate(rows)}
    size_of = {b.id: b.bytes for b in phase.buffers}

    module_of = tensor_modules(plan, phase)
    g = graphviz.Digraph("lifetimes", engine="neato")
    # layout=neato makes a plain `dot -Tsvg` of the .dot file honour the pinned positions too.
    g.attr(
        layout="neato",
        overlap="true",
        splines="false",
        label=_title(
            plan, phase, "tensor lifetimes; x = schedule slot, row = physical buffer", layers
        ),
        labelloc="t",
        fontname=_FONT,
    )
    g.attr("node", fontname=_FONT, fontsize="8", shape="box", style="filled", fixedsize="true")
    for t in tenants:
        s, e = t.interval
        width = max((e - s + 1) * per_slot, 0.01)
        x = (s - first) * per_slot + width / 2
        y = -row_of[t.buffer] * row_h
        label = bar_label(module_of.get(t.id), t.id)
        g.node(
            t.id,
            label=label if width >= 0.08 * len(label) else "",
            pos=f"{x:.4f},{y:.4f}!",
            width=f"{width:.4f}",
            height=str(bar_h),
            fillcolor=_KIND_COLOUR.get(t.kind, "#dddddd"),
            color="#555555",
            penwidth="0.3",
            tooltip=_tooltip(t, module_of.get(t.id)),
        )
    for b, i in row_of.items():
        name = "no buffer" if b is None else f"buffer {b} ({human(size_of.get(b, 0))})"
        g.node(
            f"row_{i}",
            label=name,
            shape="plaintext",
            style="",
            fixedsize="false",
            pos=f"{-0.9:.4f},{-i * row_h:.4f}!",
        )
    _slot_axis(g, first, last, per_slot, y=-len(rows) * row_h)
    return g


def _slot_axis(g: graphviz.Digraph, first: int, last: int, per_slot: float, y: float) -> None:
    """Tick labels under the bars; the axis unit is the schedule slot, not time."""
    span = last - first + 1
    step = next(
        s
        for s in (1, 2, 5, 10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10**9)
        if span / s <= 12
    )
    ticks = list(range(first - first % step, last + 2, step))
    for k, slot in enumerate(t for t in ticks if t >= first):
        g.node(
            f"tick_{k}",
            label=f"|\\n{slot}",
            shape="plaintext",
            style="",
            fixedsize="false",
            fontsize="8",
            pos=f"{(slot - first) * per_slot:.4f},{y:.4f}!",
        )
    g.node(
        "axis",
        label="schedule slot (ops in one slot run together; slots are an order, not wall-clock time)",
        shape="plaintext",
        style="",
        fixedsize="false",
        pos=f"{(span * per_slot) / 2:.4f},{y - 0.45:.4f}!",
    )


# --------------------------------------------------------------------------------------- buffers


def buffers_graph(
    plan: Plan, phase: Phase, layers: Layers | None = None, columns: int = 6
) -> graphviz.Digraph:
    """Each physical buffer as a table of the tensors that reuse it, in order of first use."""
    tenants = _tenants(plan, phase, layers)
    by_buffer: dict[int | None, list[Tensor]] = defaultdict(list)
    for t in tenants:
        by_buffer[t.buffer].append(t)
    if not by_buffer:
        raise DctmsError(f"{phase.name}: no arena tenants in the selection")
    size_of = {b.id: b.bytes for b in phase.buffers}
    used = sorted(by_buffer, key=lambda b: (b is None, b))

    g = graphviz.Digraph("buffers")
    summary = (
        f"{len(tenants):,} logical tensors in {len(used)} physical buffers "
        f"(interval colouring; each buffer is as large as its largest tenant)"
    )
    g.attr(label=_title(plan, phase, summary, layers), labelloc="t", fontname=_FONT, nodesep="0.3")
    g.attr("node", shape="plaintext", fontname=_FONT, fontsize="9")
    names = []
    for b in used:
        rows = sorted(by_buffer[b], key=lambda t: (t.interval[0], t.id))
        name = "buffer_none" if b is None else f"buffer_{b}"
        names.append(name)
        g.node(name, label=_buffer_table(b, size_of.get(b, 0), rows))
    # Lay the tables out in a grid: `rank=same` rows chained by invisible edges.
    grid = [names[i : i + columns] for i in range(0, len(names), columns)]
    for r, row in enumerate(grid):
        with g.subgraph(name=f"row_{r}") as s:
            s.attr(rank="same")
            for n in row:
                s.node(n)
        if r:
            g.edge(grid[r - 1][0], row[0], style="invis")
    return g


def _buffer_table(buffer: int | None, size: int, rows: list[Tensor]) -> str:
    head = "no buffer" if buffer is None else f"buffer {buffer}"
    cells = [
        '<<table border="0" cellborder="1" cellspacing="0" cellpadding="2">',
        f'<tr><td colspan="4" bgcolor="#dddddd"><b>{head}</b>: {size:,} B ({human(size)}), '
        f"{len(rows)} tenant{'s' if len(rows) != 1 else ''}</td></tr>",
        "<tr><td><i>tensor</i></td><td><i>shape</i></td><td><i>bytes</i></td>"
        "<td><i>slots</i></td></tr>",
    ]
    for t in rows:
        colour = _KIND_COLOUR.get(t.kind, "#ffffff")
        cells.append(
            f'<tr><td bgcolor="{colour}">{_html(t.id)}</td><td>{_html(shape_text(t.shape, t.dtype))}'
            f'</td><td align="right">{t.bytes:,}</td>'
            f"<td>{t.interval[0]}-{t.interval[1]}</td></tr>"
        )
    cells.append("</table>>")
    return "".join(cells)


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ----------------------------------------------------------------------------------------- graph


@dataclass(frozen=True)
class _Source:
    """Where a tensor an op reads comes from: an op, or a phase input binding."""

    op: NumberedOp | None
    binding_kind: str | None = None  # "input" / "state" for bindings
    binding_name: str = ""


def op_graph(
    plan: Plan, phase: Phase, layers: Layers | None = None, flat: bool = False
) -> tuple[graphviz.Digraph, bool]:
    """The op graph and whether it was collapsed to layers (selections over ``FLAT_LIMIT`` ops are,
    unless ``flat``)."""
    of_op = op_layers(plan, phase)
    selected = [op for op in numbered_ops(phase) if in_range(of_op[op.index], layers)]
    if not selected:
        raise DctmsError(f"{phase.name}: no ops in the selection")
    collapsed = not flat and len(selected) > FLAT_LIMIT
    if collapsed:
        return _layer_graph(plan, phase, selected, layers), True
    return _flat_graph(plan, phase, selected, layers), False


def _sources(phase: Phase) -> dict[str, _Source]:
    out: dict[str, _Source] = {}
    for b in phase.inputs:
        if b.kind in ("input", "state"):
            out[b.id] = _Source(None, b.kind, b.name)
    for op in numbered_ops(phase):
        for t in op.outputs:
            out[t] = _Source(op)
    return out


def _shapes(phase: Phase) -> dict[str, str]:
    shapes = {b.id: shape_text(b.shape, b.dtype) for b in phase.inputs}
    shapes.update({t.id: shape_text(t.shape, t.dtype) for t in phase.tensors})
    return shapes


def _flat_graph(
    plan: Plan, phase: Phase, selected: list[NumberedOp], layers: Layers | None
) -> graphviz.Digraph:
    g = graphviz.Digraph("graph")
    g.attr(
        label=_title(
            plan, phase, f"{len(selected):,} ops (weights and constants not drawn)", layers
        ),
        labelloc="t",
        fontname=_FONT,
        rankdir="TB",
    )
    g.attr("node", fontname=_FONT, fontsize="9", shape="box", style="rounded,filled")
    g.attr("edge", fontname=_FONT, fontsize="7", color="#666666")
    chosen = {op.index for op in selected}
    of_layer, of_module = op_layers(plan, phase), op_modules(plan, phase)
    by_layer: dict[int | None, list[NumberedOp]] = defaultdict(list)
    for op in selected:
        by_layer[of_layer[op.index]].append(op)
    for layer, ops in sorted(by_layer.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
        key = "model" if layer is None else str(layer)
        with g.subgraph(name=f"cluster_{key}") as c:
            c.attr(label=layer_name(layer), style="rounded", color="#999999")
            by_module: dict[str, list[NumberedOp]] = defaultdict(list)
            for op in ops:
                by_module[of_module[op.index] or ""].append(op)
            for k, (module, members) in enumerate(by_module.items()):
                with c.subgraph(name=f"cluster_{key}_{k}") as m:
                    if module:
                        m.attr(label=_module_label(module), style="dashed", color="#bbbbbb")
                    else:
                        m.attr(label="", style="invis")
                    for op in members:
                        m.node(
                            f"op{op.index}",
                            label=f"{op.primitive}\\n#{op.index}",
                            fillcolor="#fdd0a2" if op.memory_bound else "#f0f0f0",
                            tooltip=f"op {op.index} {op.primitive} ({module or 'no module'}) -> "
                            f"{', '.join(op.outputs)}",
                        )
    sources, shapes = _sources(phase), _shapes(phase)
    external: set[str] = set()
    for op in selected:
        for t in op.inputs:
            src = sources.get(t)
            if src is None:
                continue  # a weight or a constant
            if src.op is None:
                name = f"in_{t}"
                if name not in external:
                    external.add(name)
                    g.node(
                        name,
                        label=f"{src.binding_name}\\n({src.binding_kind})",
                        shape="ellipse",
                        fillcolor="#ffffff",
                    )
                tail = name
            elif src.op.index in chosen:
                tail = f"op{src.op.index}"
            else:
                tail = _outside(g, external, of_layer[src.op.index])
            g.edge(tail, f"op{op.index}", label=shapes.get(t, ""))
    _flat_outputs(g, phase, selected, chosen, external, shapes, of_layer)
    return g


def _module_label(path: str) -> str:
    """A module cluster's label: its path below the layer (``self_attn.q_proj``)."""
    names = path.split(".")
    cut = next((i + 1 for i, n in enumerate(names) if n.isdigit()), 0)
    return ".".join(names[cut:]) or path


def _outside(g: graphviz.Digraph, seen: set[str], layer: int | None) -> str:
    """One dashed node stands for every op of a group that is not in the selection."""
    name = f"outside_{'model' if layer is None else layer}"
    if name not in seen:
        seen.add(name)
        g.node(name, label=f"{layer_name(layer)}\\n(not shown)", style="dashed", shape="box")
    return name


def _flat_outputs(
    g: graphviz.Digraph,
    phase: Phase,
    selected: list[NumberedOp],
    chosen: set[int],
    external: set[str],
    shapes: dict[str, str],
    of_layer: list[int | None],
) -> None:
    readers: dict[str, set[int | None]] = defaultdict(set)
    for op in numbered_ops(phase):
        if op.index not in chosen:
            for t in op.inputs:
                readers[t].add(of_layer[op.index])
    outputs = {b.id: b for b in phase.outputs if b.kind == "output"}
    for op in selected:
        for t in op.outputs:
            if t in outputs:
                g.node(f"out_{t}", label=f"{outputs[t].name}\\n(output)", shape="ellipse")
                g.edge(f"op{op.index}", f"out_{t}", label=shapes.get(t, ""))
            for layer in sorted(readers.get(t, ()), key=lambda x: (x is not None, x or 0)):
                g.edge(f"op{op.index}", _outside(g, external, layer), label=shapes.get(t, ""))


def _layer_graph(
    plan: Plan, phase: Phase, selected: list[NumberedOp], layers: Layers | None
) -> graphviz.Digraph:
    """One node per layer; "model" ops split by whether they run before or after the layers."""
    group = _groups(phase, op_layers(plan, phase))
    chosen = {op.index for op in selected}
    g = graphviz.Digraph("graph")
    what = (
        f"{len(selected):,} ops collapsed to layers (--flat expands; edges: tensors crossing "
        f"between groups)"
    )
    g.attr(label=_title(plan, phase, what, layers), labelloc="t", fontname=_FONT, rankdir="TB")
    g.attr("node", fontname=_FONT, fontsize="10", shape="box", style="rounded,filled")
    g.attr("edge", fontname=_FONT, fontsize="8", color="#666666")
    members: dict[str, list[NumberedOp]] = defaultdict(list)
    for op in selected:
        members[group[op.index]].append(op)
    sources, shapes = _sources(phase), _shapes(phase)
    shared = _shared_tensors(phase, sources, group)
    for name, ops in members.items():
        bound = sum(op.memory_bound for op in ops)
        made = [t for op in ops for t in op.outputs if t in shared]
        readers = set().union(*(shared[t] for t in made)) if made else set()
        note = (
            f"\\n+ {len(made)} tensors shared with {len(readers)} other groups (not drawn)"
            if made
            else ""
        )
        g.node(
            _node_id(name),
            label=f"{name}\\n{len(ops)} ops, {bound} memory-bound{note}",
            fillcolor="#f0f0f0" if name.startswith("layer") else "#dadaeb",
        )
    crossing: dict[tuple[str, str], set[str]] = defaultdict(set)
    for op in numbered_ops(phase):
        for t in op.inputs:
            src = sources.get(t)
            if src is None or (src.op is None and src.binding_kind != "input"):
                continue  # weights, constants, KV cache
            if t in shared:
                continue  # one value every later layer reads: noted on its group, not drawn
            tail = "inputs" if src.op is None else group[src.op.index]
            head = group[op.index]
            head_in = op.index in chosen
            # Phase inputs are drawn only where a selected op reads them.
            tail_in = head_in if src.op is None else src.op.index in chosen
            if tail == head or not (tail_in or head_in):
                continue
            if not tail_in:  # one end outside the selection: a dashed stand-in for its group
                tail = f"{tail} (not shown)"
            elif not head_in:
                head = f"{head} (not shown)"
            crossing[(tail, head)].add(t)
    outputs = {b.id: b.name for b in phase.outputs if b.kind == "output"}
    for op in selected:
        for t in op.outputs:
            if t in outputs:
                crossing[(group[op.index], f"{outputs[t]} (output)")].add(t)
    drawn = set(members)
    for (tail, head), tensors in sorted(crossing.items()):
        for end in (tail, head):
            if end not in drawn:
                drawn.add(end)
                dashed = end.endswith("(not shown)")
                g.node(
                    _node_id(end),
                    label=end,
                    style="dashed" if dashed else "filled",
                    shape="box" if dashed else "ellipse",
                    fillcolor="#ffffff",
                )
        g.edge(_node_id(tail), _node_id(head), label=_crossing_label(tensors, shapes))
    return g


SHARED_READERS = 3  # a tensor read by this many other groups is shared, not a layer-to-layer edge


def _shared_tensors(
    phase: Phase, sources: dict[str, _Source], group: dict[int, str]
) -> dict[str, set[str]]:
    """Tensors an op computes once and ``SHARED_READERS`` or more other groups read (the rotary
    angles and the mask, merged across layers by the compiler) -> the groups reading them: drawn
    as edges they would tie one layer to every later one."""
    readers: dict[str, set[str]] = defaultdict(set)
    for op in numbered_ops(phase):
        for t in op.inputs:
            src = sources.get(t)
            if src is not None and src.op is not None and group[src.op.index] != group[op.index]:
                readers[t].add(group[op.index])
    return {t: r for t, r in readers.items() if len(r) >= SHARED_READERS}


def _groups(phase: Phase, of_layer: list[int | None]) -> dict[int, str]:
    """Op index -> collapsed group: "layer k", or for model-level ops "model (before layers)" /
    "model (after layers)" depending on whether they read anything a layer computed."""
    after_layers: set[str] = set()  # tensors that depend on some layer's output
    group: dict[int, str] = {}
    for op in numbered_ops(phase):  # ops are in schedule order, so producers come first
        if of_layer[op.index] is not None:
            group[op.index] = f"layer {of_layer[op.index]}"
            after_layers.update(op.outputs)
        elif any(t in after_layers for t in op.inputs):
            group[op.index] = "model (after layers)"
            after_layers.update(op.outputs)
        else:
            group[op.index] = "model (before layers)"
    return group


def _node_id(name: str) -> str:
    return "g_" + "".join(ch if ch.isalnum() else "_" for ch in name)


def _crossing_label(tensors: set[str], shapes: dict[str, str]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for t in tensors:
        counts[shapes.get(t, "?")] += 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"{s} x{n}" if n > 1 else s for s, n in top[:3]]
    if len(top) > 3:
        lines.append(f"+{len(top) - 3} more shapes")
    noun = "tensor" if len(tensors) == 1 else "tensors"
    return f"{len(tensors)} {noun}\\n" + "\\n".join(lines)
