"""The A/B protocol: warm-up, interleaved calls, ``calls.json`` after every call, Ctrl-C.

Order: for each repetition, for each prompt, the baseline and then the runner — the two systems
alternate call by call, so slow drift (thermals, background load, page cache) reaches both alike.
``calls.json`` is rewritten atomically (temporary file in the same folder, then rename) after every
call: a run stopped at any point leaves a valid file holding every completed call. On Ctrl-C the
call in progress is dropped and the summary is written for what completed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dctms.benchmark.progress import ProgressBar
from dctms.benchmark.prompts import PromptIds
from dctms.benchmark.systems import System, measure_call
from dctms.schema.output import write_output

FORMAT = "dctms-bench-calls/1"
CALLS_NAME = "calls.json"

Measure = Callable[[System, list[int], int, set[int]], dict]


@dataclass
class Settings:
    reps: int
    max_tokens: int
    warmup: int = 1
    stop: set[int] = field(default_factory=set)


def schedule(n_prompts: int, reps: int, n_systems: int = 2) -> list[tuple[int, int, int]]:
    """``(rep, prompt index, system index)`` in run order: systems alternate call by call."""
    return [(rep, p, s) for rep in range(reps) for p in range(n_prompts) for s in range(n_systems)]


class CallsFile:
    """``calls.json``: header fields, then ``warmup`` and ``calls`` with one call per line.

    Each call is serialised once when it is added; a rewrite only joins the stored lines."""

    def __init__(self, path: Path, header: dict):
        self.path = path
        self.header = dict(header)
        self.warmup: list[str] = []
        self.calls: list[str] = []
        self.records: list[dict] = []
        self.warmup_records: list[dict] = []

    def add(self, call: dict, warmup: bool = False) -> None:
        line = json.dumps(call, separators=(",", ":"), allow_nan=False)
        (self.warmup if warmup else self.calls).append(line)
        (self.warmup_records if warmup else self.records).append(call)

    def text(self) -> str:
        head = {**self.header, "completed_calls": len(self.calls)}
        parts = [f" {json.dumps(k)}: {json.dumps(v, allow_nan=False)}" for k, v in head.items()]
        for key, lines in (("warmup", self.warmup), ("calls", self.calls)):
            body = ",\n".join(f"  {line}" for line in lines)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]" if lines else f' "{key}": []')
        return "{\n" + ",\n".join(parts) + "\n}\n"

    def write(self, status: str) -> None:
        self.header["status"] = status
        write_output(self.path, self.text().encode())


@dataclass
class Outcome:
    calls: list[dict]
    warmup: list[dict]
    planned: int
    interrupted: bool
    elapsed_s: float


def run_protocol(
    systems: Sequence[System],
    prompts: Sequence[PromptIds],
    settings: Settings,
    calls_file: CallsFile,
    progress: ProgressBar | None = None,
    measure: Measure = measure_call,
    before_rep: Callable[[int], bool] | None = None,
) -> Outcome:
    """Run warm-up and the interleaved calls; ``calls.json`` is current after every call.

    ``before_rep(rep)`` runs before each later repetition (``benchmark.loading``: the systems
    re-loaded in the other order, in place in ``systems``); when it returns True the warm-up
    calls are made again before that repetition's first call.
    Returns on completion or on KeyboardInterrupt (``interrupted``), never raising it."""
    order = schedule(len(prompts), settings.reps, len(systems))
    bar = progress or ProgressBar(len(order), enabled=False)
    t_start = time.perf_counter()
    interrupted = False
    calls_file.write("running")

    def warm_up(rep: int, at: int) -> None:
        for w in range(settings.warmup):
            for system in systems:
                p = prompts[0]
                bar.update(at, f"warm-up {w + 1}/{settings.warmup} {p.prompt.id} {system.name}")
                call = _call(measure, system, p, settings, t_start)
                calls_file.add({"warmup": w, "before_rep": rep, **call}, warmup=True)
                calls_file.write("running")

    try:
        warm_up(0, 0)
        for i, (rep, pi, si) in enumerate(order):
            if before_rep is not None and rep > 0 and pi == 0 and si == 0 and before_rep(rep):
                bar.update(i, f"re-loading both systems for rep {rep + 1}")
                warm_up(rep, i)
            system, p = systems[si], prompts[pi]
            bar.update(i, f"rep {rep + 1}/{settings.reps} {p.prompt.id} {system.name}")
            call = _call(measure, system, p, settings, t_start)
            calls_file.add({"index": i, "rep": rep, **call})
            calls_file.write("running")
        bar.update(len(order), "done")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    calls_file.write("interrupted" if interrupted else "complete")
    return Outcome(
        calls_file.records,
        calls_file.warmup_records,
        len(order),
        interrupted,
        time.perf_counter() - t_start,
    )


def _call(measure: Measure, system: System, p: PromptIds, s: Settings, t_start: float) -> dict:
    started = time.perf_counter() - t_start
    result = measure(system, p.ids, s.max_tokens, s.stop)
    return {
        "prompt": p.prompt.id,
        "system": system.name,
        "start_s": round(started, 4),
        **result,
    }
