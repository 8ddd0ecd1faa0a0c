"""A bounded load on `dctms serve` (bench/serve_load.py, tiny models): 200 requests from 8
concurrent openai clients on 127.0.0.1, every one answered or cleanly refused, every answer equal
to `dctms run`'s, MLX's observed peak within the pool envelope at every /status poll."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")  # the test extra; `make setup` installs it

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"


@pytest.mark.slow
def test_200_requests_from_8_clients_all_answered_within_the_envelope(tmp_path):
    out = tmp_path / "load.json"
    cmd = [
        sys.executable, str(SCRIPT), "--tiny", "--requests", "200", "--clients", "8",
        "--time-limit", "240", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outcomes = result["outcomes"]
    assert set(outcomes) <= {"answered", "refused"}, outcomes
    assert outcomes["answered"] + outcomes.get("refused", 0) == 200
    # the deliberate over-M requests (every 25th) and only those were refused with 400
    assert result["deliberate_refusals"] == 8
    assert sum(r.get("status") == 400 for r in result["records"]) == 8
    assert result["mismatches_vs_dctms_run"] == []
    assert result["status_samples"] > 0 and result["samples_over_envelope"] == 0
    assert 0 < result["observed_mlx_peak_bytes"] <= result["envelope_provable_bytes"]
    assert result["max_peak_sampled_bytes"] <= result["envelope_provable_bytes"]
    assert result["server_exit_status"] == 0
    assert result["max_queue_waiting_sampled"] >= 1  # requests did queue behind the busy worker
    streamed = [r for r in result["records"] if r["outcome"] == "answered" and r["stream"]]
    plain = [r for r in result["records"] if r["outcome"] == "answered" and not r["stream"]]
    assert streamed and plain and {r["model"] for r in plain} == {"demo", "small"}
    assert "all checks: PASS" in proc.stdout
