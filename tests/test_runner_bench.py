"""``bench/runner_vs_mlx_lm.py`` is a thin entry over the one A/B harness (``dctms bench``): it
builds its random model, compiles the plan and writes what ``dctms bench`` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "runner_vs_mlx_lm.py"


@pytest.mark.slow
def test_benchmark_script_runs_dctms_bench(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"id": "P1", "category": "short", "text": "a short prompt"}]))
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(SCRIPT), "--reps", "2", "--max-tokens", "6", "-N", "32",
        "--hidden", "64", "--layers", "1", "--vocab", "512", "--dir", str(tmp_path / "model"),
        "--out", str(out), "--prompts", str(prompts), "--no-plot", "-q", "--warmup", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "runner ÷ baseline" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["paired_calls"] == 4  # 2 repetitions x 1 prompt x 2 systems
    assert summary["greedy_agreement"]["P1"]["identical"]
    (row,) = summary["parity"]
    assert row["within_envelope"] and row["decode_ratio"] > 0
    assert row["baseline_roofline"] > 0 and row["runner_roofline"] > 0
    assert "--ignore-eos" in summary["settings"]["stop"]
