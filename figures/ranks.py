"""The ranks of a distributed model: which layers each runs, its collectives, its envelope.

Rows for ``dctms show`` (one plan or a folder of rank plans), ``dctms compile --ranks`` and
``dctms run --ranks`` (with what each rank observed); the inspector's Overview shows ``rank_label``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dctms.schema.types import Plan

COLLECTIVE_PRIMITIVES = ("AllReduce", "AllGather", "Send", "Recv")


@dataclass(frozen=True)
class RankRow:
    rank: int
    layers: str  # "1-2": the decoder layers the rank runs, in the model's numbering
    weights: int
    kv: int
    intermediate: int
    provable: int  # M_max without the runtime allowance (what MLX's peak must stay under)
    total: int  # M_max
    shard: str = ""  # tensor parallel: "1 of 2" (every rank runs every layer, a slice of each)


def rank_label(plan: Plan) -> str | None:
    """``rank 0 of 2, pipeline: layers 1-2 of 3 (split 2,1)``; None for a single-process plan."""
    d = plan.distributed
    if d is None:
        return None
    text = f"rank {d.rank} of {d.ranks}, {d.mode} parallel: layers {_layers(d.layers)} of {plan.model.num_layers}"
    if d.split:
        text += f" (split {','.join(map(str, d.split))}, rank 0 runs the last)"
    return text


def collectives(plan: Plan) -> list[tuple[str, str]]:
    """(phase, "2 AllReduce, 1 Send") for each phase of a rank's plan."""
    rows = []
    for phase in plan.phases:
        count = Counter(op.primitive for op in phase.ops if op.primitive in COLLECTIVE_PRIMITIVES)
        text = ", ".join(f"{count[p]} {p}" for p in COLLECTIVE_PRIMITIVES if count[p]) or "none"
        rows.append((phase.name, text))
    return rows


def rank_rows(plans: list[Plan]) -> list[RankRow]:
    rows = []
    for p in plans:
        e = p.envelope
        rows.append(
            RankRow(
                p.distributed.rank,
                _layers(p.distributed.layers),
                e.weights,
                e.kv,
                e.intermediate,
                e.provable,
                e.total,
                _shard(p),
            )
        )
    return rows


def largest_rank(plans: list[Plan]) -> int:
    """The rank whose M_max is the largest (the lowest such rank on a tie): the one that decides
    whether the split fits a device of a given size."""
    return max(plans, key=lambda p: (p.envelope.total, -p.distributed.rank)).distributed.rank


def _shard(plan: Plan) -> str:
    d = plan.distributed
    return f"{d.rank} of {d.ranks}" if d.mode == "tensor" else ""


def _layers(span: list[int]) -> str:
    start, end = span
    return f"{start}-{end - 1}" if end - start > 1 else str(start)
