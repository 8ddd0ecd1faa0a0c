"""A vision-language plan's streams as rows: which phases run on which stream, on which MLX
stream, and the largest call of each (what one envelope covers at once when they overlap)."""

from __future__ import annotations

from dataclasses import dataclass

from dctms.schema.types import Plan
from dctms.schema.vision_bytes import transient_bytes


@dataclass(frozen=True)
class StreamRow:
    name: str  # vision | text | output
    mlx_stream: int
    phases: tuple[str, ...]
    largest_call: int  # bytes: the largest arena (+ slack, + a vision call's inputs) among them


def stream_rows(plan: Plan) -> list[StreamRow]:
    """One row per stream of a vision-language plan; empty for a text plan."""
    if plan.vision is None:
        return []
    calls = {p.name: p.arena_bytes + p.slack_bytes + transient_bytes(plan, p) for p in plan.phases}
    return [
        StreamRow(
            s.name,
            s.mlx_stream,
            tuple(s.phases),
            max((calls.get(p, 0) for p in s.phases), default=0) if s.name != "output" else 0,
        )
        for s in plan.vision.streams
    ]


def stream_of(plan: Plan) -> dict[str, tuple[str, int]]:
    """Phase name -> (stream, MLX stream) for the vision and text streams of a plan."""
    return {
        p: (row.name, row.mlx_stream)
        for row in stream_rows(plan)
        if row.name != "output"
        for p in row.phases
    }


def phase_labels(plan: Plan) -> list[str]:
    """Each phase's name, with its stream in a vision-language plan (``vision.56x84 (vision)``);
    the names alone in a text plan."""
    streams = stream_of(plan)
    return [
        f"{p.name} ({streams[p.name][0]})" if p.name in streams else p.name for p in plan.phases
    ]
