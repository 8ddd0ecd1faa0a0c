"""``dctms selftest``: compiles and runs a tiny model here, provable vs observed and ids vs mlx-lm;
``--backend gpu`` without a GPU is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _dctms(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_selftest_on_the_cpu_passes_and_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "selftest.json"
    out = _dctms("selftest", "--report", str(report))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ids equal to mlx-lm's: yes" in out.stdout and "selftest: passed" in out.stdout
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["device"] == "cpu" and doc["target"] == "cpu"
    assert doc["runner_ids"] == doc["mlx_lm_ids"] and len(doc["runner_ids"]) == 16
    assert 0 < doc["observed_mlx_peak_bytes"] <= doc["provable_bytes"]
    # the simulator's figure (the model's) beside the measured one: within the envelope too
    assert doc["simulated_peak_bytes"] <= doc["provable_bytes"]


def test_selftest_gpu_without_a_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    out = _dctms("selftest", "--backend", "gpu", "--report", str(report))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "has no GPU (it runs on cpu)" in lines[0]
    assert not report.exists()
