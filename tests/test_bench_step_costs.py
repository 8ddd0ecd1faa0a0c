"""bench/step_costs.py end to end on a tiny model: every call it names is timed in both systems,
and the table has one row per call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import build_tiny_models

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_step_costs_times_each_call_in_both_systems(tmp_path: Path) -> None:
    beta = build_tiny_models(tmp_path)["beta"]
    out = tmp_path / "costs.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_costs.py"), "--model", str(beta.folder),
         "-N", "96", "-M", "8", "--batch", "4", "--position", "20", "--repeats", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for system in ("dctms", "mlx_lm"):
        assert sorted(data[system]["decode_ms"]) == ["1", "2", "4"]
        assert sorted(data[system]["prefill_ms"], key=int) == ["16", "32", "64"]
        assert all(v > 0 for v in data[system]["decode_ms"].values())
    assert data["mlx_lm"]["weight_floor_ms"] > 0 and data["mlx_lm"]["weights_bytes"] > 0
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 + 3 + 1  # header, decode rows, prefill lengths, the floor
