"""Smoke test for ``bench/runner_vs_mlx_lm.py`` (tiny settings), so the benchmark does not rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "runner_vs_mlx_lm.py"


@pytest.mark.slow
def test_benchmark_script_runs_and_reports_ratios(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(SCRIPT), "--rounds", "2", "--tokens", "8", "--prompt-tokens", "12",
        "--hidden", "64", "--layers", "1", "--vocab", "512",
        "--dir", str(tmp_path / "model"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "outputs identical in every round: yes" in proc.stdout
    assert "tok/s runner / mlx-lm = " in proc.stdout
    assert "CV_L (per-token decode latency) runner / mlx-lm = " in proc.stdout
    result = json.loads(out.read_text())
    assert result["outputs_identical"]
    assert result["ratios"]["tok_s_runner_over_mlx_lm"] > 0
    for name in ("runner", "mlx_lm"):
        runs = result["raw"][name]
        assert len(runs) == 2
        assert all(len(r["decode_latencies_s"]) == 7 and len(r["tokens"]) == 8 for r in runs)
        assert result["summary"][name]["per_token"]["n"] == 14
    assert result["summary"]["runner"]["own_mlx_peak_bytes"] <= result["provable_bytes"]
