"""Text of the per-rank figures (``dctms.figures.ranks``): the rank table and a rank's section."""

from __future__ import annotations

from dctms.figures.ranks import collectives, rank_rows
from dctms.figures.units import MIB
from dctms.schema.types import Plan


def rank_table(plans: list[Plan], observed: dict[int, dict] | None = None) -> str:
    """One line per rank (MiB): layers, weights, KV, arena, provable peak, M_max; after a run,
    the MLX and RSS peaks each rank observed."""
    head = (
        f"{'rank':>4} {'layers':>8} {'weights':>10} {'kv':>8} {'arena':>8} "
        f"{'provable':>10} {'M_max':>10}"
    )
    if observed:
        head += f" {'MLX peak':>10} {'RSS peak':>10}"
    lines = [head + "   (MiB)"]
    for r in rank_rows(plans):
        row = (
            f"{r.rank:>4} {r.layers:>8} {r.weights / MIB:>10.3f} {r.kv / MIB:>8.3f} "
            f"{r.intermediate / MIB:>8.3f} {r.provable / MIB:>10.3f} {r.total / MIB:>10.3f}"
        )
        if observed and r.rank in observed:
            o = observed[r.rank]
            row += f" {o['mlx_peak_bytes'] / MIB:>10.3f} {o['rss_peak_bytes'] / MIB:>10.3f}"
        lines.append(row)
    return "\n".join(lines)


def rank_section(plan: Plan) -> str | None:
    """``dctms show``'s distributed section of a rank's plan (None for a single process)."""
    if plan.distributed is None:
        return None  # the rank itself is a bounds row (figures.overview)
    lines = ["distributed"]
    lines += [f"  collectives in {name:<9} {text}" for name, text in collectives(plan)]
    d = plan.distributed
    shards = sum(1 for w in plan.model.weights.tensors if w.shard is not None)
    if shards:
        lines.append(f"  {shards} weights are this rank's shard of the stored tensor")
    if d.skipped_weights:
        lines.append(
            f"  {len(d.skipped_weights)} stored weights belong to other ranks (not loaded)"
        )
    return "\n".join(lines)
