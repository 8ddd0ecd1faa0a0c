"""One benchmark from loaded systems to files: protocol, then summary and figures (also after Ctrl-C)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import dctms
from dctms.benchmark import stats
from dctms.benchmark import systems as systems_mod
from dctms.benchmark.progress import ProgressBar
from dctms.benchmark.prompts import PromptIds
from dctms.benchmark.protocol import (
    CALLS_NAME,
    FORMAT,
    CallsFile,
    Measure,
    Outcome,
    Settings,
    run_protocol,
    schedule,
)
from dctms.benchmark.report import summarise, write_summary
from dctms.benchmark.systems import System


def prompt_entries(prompts: Sequence[PromptIds]) -> list[dict]:
    return [
        {
            "id": p.prompt.id,
            "category": p.prompt.category,
            "tokens": len(p.ids),
            "text_bytes": len(p.prompt.text.encode("utf-8")),
        }
        for p in prompts
    ]


def execute(
    systems: Sequence[System],
    prompts: Sequence[PromptIds],
    settings: Settings,
    out_dir: Path,
    described: dict,
    resamples: int = stats.DEFAULT_RESAMPLES,
    seed: int = stats.DEFAULT_SEED,
    progress: ProgressBar | None = None,
    measure: Measure | None = None,
    figures: bool = True,
    before_rep: Callable[[int], bool] | None = None,
) -> tuple[Outcome, dict, str]:
    """Run the protocol into ``out_dir`` and write ``summary.md``/``summary.json`` and the figures
    for whatever completed. Returns the outcome, the summary and the figures note ("" if written).

    ``measure`` defaults to ``systems.measure_call``, looked up at call time (a test hook)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "format": FORMAT,
        "dctms_version": dctms.__version__,
        "status": "running",
        "planned_calls": len(schedule(len(prompts), settings.reps, len(systems))),
        "settings": described,
        "prompts": prompt_entries(prompts),
    }
    calls_file = CallsFile(out_dir / CALLS_NAME, header)
    outcome = run_protocol(
        systems,
        prompts,
        settings,
        calls_file,
        progress,
        measure or systems_mod.measure_call,
        before_rep,
    )
    summary = summarise(calls_file.header, outcome.calls, resamples=resamples, seed=seed)
    names: list[str] = []
    note = "figures not requested (--no-plot)"
    if figures:
        from dctms.benchmark.plot import write_figures

        names, note = write_figures(out_dir, outcome.calls, [p.prompt.id for p in prompts])
    write_summary(out_dir, summary, names, note)
    return outcome, summary, note
