"""What a finished ``dctms run`` prints: the summary table, the line saying where the generation
stopped, and the envelope verdict (exit 3 when the observed peak went past the provable peak).

Shared by every kind of run (``commands.run``, ``run_vision``, ``distributed``), so none of them
imports another to print it.
"""

from __future__ import annotations

import sys

from dctms.figures.units import MIB

EXIT_OVER_ENVELOPE = 3


def length_line(max_tokens: int | None, plan_m: int) -> str:
    """The one stderr line of a run that ended at its token bound, not at a stop."""
    if max_tokens is not None:
        return f"stopped at --max-tokens {max_tokens}"
    return f"stopped at the plan bound M = {plan_m}"


def envelope_verdict(report: dict) -> int:
    """0 when the run stayed within the provable peak; else one stderr line and exit 3."""
    if report["within_envelope"]:
        return 0
    print(
        f"dctms run: observed MLX peak {report['observed']['mlx_peak_bytes']} bytes exceeds the "
        f"plan's provable peak {report['provable_bytes']} bytes",
        file=sys.stderr,
    )
    return EXIT_OVER_ENVELOPE


def summary(report: dict) -> str:
    from dctms.runner.blas import BlasInfo

    obs = report["observed"]
    return "\n".join(
        [
            f"generated {len(report['tokens'])} tokens; TTFT {report['ttft_s'] * 1000:.1f} ms; "
            f"decode {report['tokens_per_s']:.1f} tok/s",
            f"{'':24}{'bytes':>16}{'MiB':>12}",
            f"{'provable peak':24}{report['provable_bytes']:>16,}{report['provable_bytes'] / MIB:>12.2f}",
            f"{'observed MLX peak':24}{obs['mlx_peak_bytes']:>16,}{obs['mlx_peak_bytes'] / MIB:>12.2f}",
            f"{'M_max':24}{report['envelope']['total']:>16,}"
            f"{report['envelope']['total'] / MIB:>12.2f}",
            f"{'observed RSS peak':24}{obs['rss_peak_bytes']:>16,}{obs['rss_peak_bytes'] / MIB:>12.2f}",
            f"within envelope: {'yes' if report['within_envelope'] else 'NO'} "
            f"(provable peak / observed = {_ratio(report['envelope_over_observed'])})",
            f"BLAS: {BlasInfo(**report['blas']).describe()}",
            *_weights_line(report.get("weights")),
            *_setup_line(report.get("setup")),
        ]
    )


def _weights_line(weights: dict | None) -> list[str]:
    from dctms.runner.weight_arena import ArenaInfo

    return [f"weights: {ArenaInfo(**weights).describe()}"] if weights else []


def _setup_line(setup: dict | None) -> list[str]:
    if not setup:
        return []
    return [
        f"set-up: graphs of {setup['recorded_points']} length points recorded in "
        f"{setup['record_s']:.2f} s before the first token (not in TTFT)"
    ]


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
