"""The benchmark's picture: latency per prompt (both systems) and process RSS over the run.

matplotlib is the optional extra ``dctms[plot]``; it is imported here, lazily, through its
object-oriented API only (no pyplot, no global backend switch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dctms.benchmark.systems import BASELINE, LABELS, RUNNER
from dctms.figures.units import MIB

FIGURE_STEM = "bench"
COLORS = {BASELINE: "#4c72b0", RUNNER: "#dd8452"}


def write_figures(
    out_dir: Path, calls: Sequence[dict], prompt_ids: Sequence[str]
) -> tuple[list[str], str]:
    """Write ``bench.png`` and ``bench.svg``; returns (file names, note). Without matplotlib the
    list is empty and the note says why."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], "matplotlib is not installed (pip install 'dctms[plot]'): figures skipped"
    if not calls:
        return [], "no completed calls: figures skipped"

    fig = Figure(figsize=(max(8.0, 2.2 * len(prompt_ids)), 7.5), layout="constrained")
    grid = fig.add_gridspec(2, len(prompt_ids), height_ratios=[1.1, 1.0])
    for col, pid in enumerate(prompt_ids):
        ax = fig.add_subplot(grid[0, col])
        data = [
            [c["latency_s"] * 1000 for c in calls if c["prompt"] == pid and c["system"] == sys]
            for sys in (BASELINE, RUNNER)
        ]
        present = [i for i, d in enumerate(data) if d]
        if present:
            box = ax.boxplot(
                [data[i] for i in present],
                positions=[i + 1 for i in present],
                widths=0.5,
                patch_artist=True,
                showfliers=False,
                medianprops={"color": "black"},
            )
            for patch, i in zip(box["boxes"], present, strict=True):
                patch.set_facecolor(COLORS[(BASELINE, RUNNER)[i]])
                patch.set_alpha(0.35)
            for i in present:
                n = len(data[i])
                # Deterministic horizontal spread of the individual calls.
                xs = [i + 1 + (k / max(n - 1, 1) - 0.5) * 0.3 for k in range(n)]
                ax.scatter(xs, data[i], s=9, color=COLORS[(BASELINE, RUNNER)[i]], zorder=3)
        ax.set_xticks([1, 2], ["baseline", "runner"], fontsize=8)
        ax.set_xlim(0.4, 2.6)
        ax.set_title(pid, fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
        if col == 0:
            ax.set_ylabel("latency per call (ms)")

    ax = fig.add_subplot(grid[1, :])
    for sys in (BASELINE, RUNNER):
        first = True
        for c in calls:
            if c["system"] != sys or not c.get("rss_series"):
                continue
            t = [c["start_s"] + s[0] for s in c["rss_series"]]
            rss = [s[1] / MIB for s in c["rss_series"]]
            ax.plot(t, rss, color=COLORS[sys], linewidth=1.0, label=LABELS[sys] if first else None)
            first = False
    ax.set_xlabel("time since the start of the run (s)")
    ax.set_ylabel("process RSS (MiB), 10 ms samples")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("dctms bench: latency per prompt and RSS over time")

    names = [f"{FIGURE_STEM}.png", f"{FIGURE_STEM}.svg"]
    for name in names:
        fig.savefig(out_dir / name, dpi=120)
    return names, ""
