"""Soak: >= 1,000 decode steps over repeated ``generate`` calls in one Session without growth.

A fresh interpreter (so the RSS is the runner's alone) builds one Session and calls ``generate``
40 times with prompts of varying length (short, one chunk, several chunks), sampling RSS (psutil)
and MLX's active memory after each call. The least-squares slope of RSS against the cumulative
number of decode steps over the second half must stay below 1 KiB per step; MLX's active memory
must not change at all between calls. The slope is printed and written to ``soak.json`` in the
test's temporary folder (the source tree is never written to).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

N, M, CHUNK = 48, 32, 16
CALLS = 40  # x (M - 1) = 1,240 decode steps
MAX_SLOPE = 1024.0  # bytes per decode step

CONFIG = dict(TINY_QWEN2)

_SOAK = textwrap.dedent(
    """
    import gc, json, sys, time
    import mlx.core as mx, psutil
    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.schema.model_folder import open_model_folder
    from dctms.runner.session import Session
    plan_path, folder, calls, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    proc = psutil.Process()
    session = Session(load_checked_plan(plan_path), open_model_folder(folder))
    samples = []
    steps = 0
    t0 = time.perf_counter()
    for call in range(calls):
        n = (5, 16, 37, 48)[call % 4]
        prompt = [(i * 31 + call) % 256 for i in range(n)]
        gen = session.generate(validate_request(session.plan, prompt, max_tokens))
        steps += len(gen.token_latencies_s)
        samples.append([steps, proc.memory_info().rss, mx.get_active_memory()])
    print(json.dumps({"samples": samples, "seconds": time.perf_counter() - t0,
                      "peak": mx.get_peak_memory(), "provable": session.plan.envelope.provable}))
    """
)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def test_slope_is_least_squares():
    assert slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert slope([0, 1, 2, 3], [4, 4, 4, 4]) == 0.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan
    from dctms.toolkit.tiny_model import write_tiny_model

    folder = tmp_path_factory.mktemp("soak-model")
    write_tiny_model(folder, CONFIG, seed=5)
    plan = compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))
    write_plan(plan, folder / "model.plan")
    return folder / "model.plan", folder


@pytest.mark.slow
def test_soak_thousand_decode_steps_no_growth(model, tmp_path: Path):
    plan, folder = model
    proc = subprocess.run(
        [sys.executable, "-c", _SOAK, str(plan), str(folder), str(CALLS), str(M)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    samples = result["samples"]
    steps = [s[0] for s in samples]
    rss = [s[1] for s in samples]
    active = [s[2] for s in samples]
    assert steps[-1] == CALLS * (M - 1) >= 1000

    half = len(samples) // 2
    rss_slope = slope(steps[half:], rss[half:])
    active_slope = slope(steps[half:], active[half:])
    summary = {
        "decode_steps": steps[-1],
        "calls": CALLS,
        "seconds": round(result["seconds"], 2),
        "rss_slope_bytes_per_step_second_half": rss_slope,
        "rss_slope_bytes_per_step_all": slope(steps, rss),
        "rss_first_last_bytes": [rss[0], rss[-1]],
        "active_slope_bytes_per_step": active_slope,
        "active_min_max_bytes": [min(active), max(active)],
        "mlx_peak_bytes": result["peak"],
        "provable_bytes": result["provable"],
        "threshold_bytes_per_step": MAX_SLOPE,
    }
    (tmp_path / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"\nsoak: {steps[-1]} decode steps in {result['seconds']:.1f} s; RSS slope (second half) "
        f"{rss_slope:.1f} B/step, overall {summary['rss_slope_bytes_per_step_all']:.1f} B/step; "
        f"RSS {rss[0]:,} -> {rss[-1]:,}; MLX active {min(active):,}..{max(active):,}"
    )
    assert rss_slope < MAX_SLOPE, summary
    assert max(active) - min(active) <= 64, summary  # the cache is static: nothing accumulates
    assert result["peak"] <= result["provable"], summary
