"""``dctms pool``'s text: the plans' rows, what is shared and what summed, the budget verdict."""

from __future__ import annotations

from dctms.figures.pool import Pool, explanation
from dctms.figures.units import MIB


def pool_text(pool: Pool) -> str:
    rows = [
        f"{'plan':<20}{'weights':>12}{'KV':>12}{'persistent':>12}{'arena':>12}{'runtime':>12}"
        f"{'own M_max':>12}  (MiB)"
    ]
    for m in pool.members:
        rows.append(
            f"{m.name[:19]:<20}{m.weights / MIB:>12.2f}{m.kv / MIB:>12.2f}"
            f"{m.persistent / MIB:>12.2f}{m.intermediate / MIB:>12.2f}{m.runtime / MIB:>12.2f}"
            f"{m.total / MIB:>12.2f}"
        )
    mode = "concurrent calls" if pool.concurrent else "one call at a time"
    rows += ["", f"pool of {len(pool.members)} plan(s), {mode}:"]
    rows += [f"  {line}" for line in explanation(pool)]
    rows += [
        "",
        _line("held (weights + KV + persistent)", pool.held),
        _line("intermediate arena", pool.intermediate),
        _line("provable peak", pool.provable),
        _line("runtime allowance", pool.runtime),
        _line("pool M_max", pool.total),
        _line("separate processes (sum of M_max)", pool.separate_total),
    ]
    if pool.budget is not None:
        rows.append(_line("budget", pool.budget))
        free = pool.free or 0
        if pool.fits:
            rows.append(_line("free", free))
            rows.append(f"all {len(pool.members)} plan(s) fit")
        else:
            k = pool.prefix_that_fits()
            rows.append(_line("shortfall", -free))
            first = ", ".join(m.name for m in pool.members[:k]) or "none"
            rows.append(
                f"does NOT fit: {-free:,} bytes short; the first {k} plan(s) fit together ({first})"
            )
    return "\n".join(rows) + "\n"


def _line(label: str, value: int) -> str:
    return f"{label:<36}{value:>18,} B{value / MIB:>14,.2f} MiB"
