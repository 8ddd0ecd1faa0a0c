"""bench/prefix_cache.py end to end on a tiny model (the one with a chat template): both dctms
systems (with and without the prefix pool) and mlx_lm.server, multi-turn chats, per-turn figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import build_tiny_models

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_runs_the_conversations_through_every_system(tmp_path: Path) -> None:
    beta = build_tiny_models(tmp_path)["beta"]
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefix_cache.py"), str(beta.folder),
         "--conversations", "2", "--turns", "3", "--max-tokens", "4", "-N", "512",
         "--blocks", "32", "--chunk", "16", "--think-s", "0.1", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"dctms-pool", "dctms", "mlx_lm"}
    for r in runs.values():
        assert [len(turn) for turn in r["turns"]] == [2, 2, 2] and r["peak_rss"] > 0
        assert all(x["ttft_s"] is not None for turn in r["turns"] for x in turn)
    pool = runs["dctms-pool"]
    # the first turn of the first chat finds nothing; later chats share the template's preamble
    assert pool["turns"][0][0]["cached"] == 0
    assert all(x["cached"] > 0 for turn in pool["turns"][1:] for x in turn)  # later turns hit
    assert all(x["cached"] is None for turn in runs["dctms"]["turns"] for x in turn)
    assert pool["observed_peak"] <= pool["provable"]
    assert "| 3 |" in proc.stdout  # the table's row for turn 3
    assert "0.1 s between an answer and the next turn" in proc.stdout
