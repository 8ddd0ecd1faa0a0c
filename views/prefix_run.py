"""``dctms show PLAN --run REPORT.json``'s pool section: the block map and the per-turn table."""

from __future__ import annotations

from dctms.figures.prefix_run import LEGEND, PoolRun, map_lines, totals_line, turn_rows

MAP_WIDTH = 64  # blocks per map line; a pool this small also gets a map per turn in the table


def pool_run_text(run: PoolRun) -> str:
    """The section (no trailing newline)."""
    lines = [
        f"prefix pool over a recorded run ({run.name}): {run.blocks} blocks of "
        f"{run.block_tokens} positions",
        "  block map at the end (block number, then one character a block):",
        *(f"    {line}" for line in map_lines(run.table, run.block_tokens, MAP_WIDTH)),
        f"  ({LEGEND})",
        f"  {totals_line(run)}",
    ]
    per_turn = run.blocks <= MAP_WIDTH
    head = f"  {'turn':>4} {'prompt':>8} {'cached':>8} {'hit':>5} {'saved':>6} {'evicted':>8}"
    lines.append(head + ("  blocks after" if per_turn else ""))
    for r in turn_rows(run):
        row = (
            f"  {r.turn:>4} {r.prompt_tokens:>8,} {r.cached_tokens:>8,} {r.hit:>5} {r.saved:>6} "
            f"{r.evicted:>8}"
        )
        lines.append(row + (f"  {r.after}" if per_turn else ""))
    return "\n".join(lines)
