"""`dctms demo` end to end: builds the tiny model offline, compiles, runs, proves the envelope."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dctms.schema.io import read_plan


def test_demo_runs_offline_and_stays_within_the_envelope(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "demo", "--dir", str(folder), "-N", "64",
         "-M", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    plan = read_plan(folder / "demo.plan")
    assert (plan.bounds.input_tokens, plan.bounds.output_tokens) == (64, 16)
    # the plan's figures and the run's observed-vs-envelope table are both shown
    assert f"{plan.envelope.total:,}" in proc.stdout
    assert "within envelope: yes" in proc.stderr
    assert f"{plan.envelope.provable:,}" in proc.stderr
    assert "generated: " in proc.stdout and "(16 tokens)" in proc.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file()
