"""Graphviz view of a vision-language plan's streams (``dctms dot PLAN --view streams``).

One cluster per stream (vision: its vision phases, one per image size; text: prefill and decode),
each phase a node with the bytes one call holds; edges inside a stream follow the run order, and a
dashed edge from the vision stream to prefill is a sync point where the streams meet (the prefill
call that first reads image k's rows waits for image k). The run order and sync points are
``dctms.figures.streams``'s worst case for the plan's bounds.
"""

from __future__ import annotations

import graphviz

from dctms.figures.streams import call_bytes, prefill_calls, sync_edges
from dctms.schema.errors import DctmsError
from dctms.schema.types import Plan

_FONT = "Helvetica"
_COLOUR = {"vision": "#d7b5e8", "text": "#9ecae1"}


def _node(name: str) -> str:
    return f"phase_{name}"


def streams_graph(plan: Plan) -> graphviz.Digraph:
    """Clusters per stream, phases as nodes, sync points as dashed edges between the clusters."""
    if plan.vision is None:
        raise DctmsError("--view streams needs a vision-language plan (compile --images K)")
    v, b = plan.vision, plan.bounds
    calls = call_bytes(plan)
    how = "vision overlaps prefill on MLX stream 1" if v.overlap else "the streams take turns"
    g = graphviz.Digraph("streams")
    g.attr(
        rankdir="LR",
        compound="true",
        label=(
            f"{plan.model.architecture} N={b.input_tokens} M={b.output_tokens}, {v.images} images "
            f"up to {v.image_size[0]}x{v.image_size[1]}: streams ({how}); "
            f"M_intermediate {plan.envelope.intermediate:,} B"
        ),
        labelloc="t",
        fontname=_FONT,
    )
    g.attr("node", fontname=_FONT, fontsize="10", shape="box", style="filled,rounded")
    g.attr("edge", fontname=_FONT, fontsize="9")
    runs = {"prefill": f" x{prefill_calls(plan)}", "decode": f" x{max(0, b.output_tokens - 1)}"}
    for stream in v.streams:
        if stream.name == "output":
            continue  # the generated tokens: no calls of their own
        with g.subgraph(name=f"cluster_stream_{stream.name}") as c:
            c.attr(
                label=f"{stream.name} stream (MLX stream {stream.mlx_stream})",
                style="rounded",
                color="grey40",
            )
            for name in stream.phases:
                c.node(
                    _node(name),
                    f"{name}{runs.get(name, '')}\\n{calls.get(name, 0):,} B per call",
                    fillcolor=_COLOUR[stream.name],
                )
            if stream.name == "text":  # prefill, then decode (a vision phase runs per image)
                for first, then in zip(stream.phases, stream.phases[1:], strict=False):
                    c.edge(_node(first), _node(then))
    for edge in sync_edges(plan):
        g.edge(
            _node(edge.vision_phase),
            _node(edge.text_phase),
            label=f"sync: prefill call {edge.call} waits for image {edge.image}",
            style="dashed",
            color="#c0392b",
            fontcolor="#c0392b",
        )
    return g
