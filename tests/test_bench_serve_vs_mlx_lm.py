"""bench/serve_vs_mlx_lm.py: its figures (percentiles, per-level aggregates) and, end to end on a
tiny model, both servers driven through the same client at two levels, under a cgroup limit too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import build_tiny_models

from dctms.benchmark.serve_clients import Answer, cached_of, level_figures, percentile

ROOT = Path(__file__).resolve().parents[1]


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile([], 50) is None


def test_level_figures_count_only_answered_requests() -> None:
    answers = [
        Answer(200, 0.1, 1.0, 10, "a"),
        Answer(200, 0.3, 2.0, 20, "b"),
        Answer(503, None, 0.1, 0, "", "HTTP 503"),
    ]
    fig = level_figures(answers, wall_s=3.0)
    assert fig["answered"] == 2 and fig["requests"] == 3
    assert fig["completion_tokens"] == 30 and fig["tok_per_s"] == 10.0
    assert fig["latency_p95_s"] == 2.0 and fig["ttft_p50_s"] == 0.1
    assert fig["errors"] == ["HTTP 503"]
    assert fig["cached_tokens"] is None  # no server said how many prompt tokens it reused
    said = [Answer(200, 0.1, 1.0, 10, "a", "", 24), Answer(200, 0.1, 1.0, 10, "b"),
            Answer(503, None, 0.1, 0, "", "HTTP 503", 99)]  # fmt: skip
    assert level_figures(said, wall_s=1.0)["cached_tokens"] == 24  # answered requests only
    assert fig["prompt_tokens"] is None and level_figures(said, 1.0)["prompt_tokens"] is None
    counted = [Answer(200, 0.1, 1.0, 10, "a", "", 24, 30), Answer(200, 0.1, 1.0, 10, "b", "", 0, 7),
               Answer(503, None, 0.1, 0, "", "HTTP 503", 99, 99)]  # fmt: skip
    assert level_figures(counted, 1.0)["prompt_tokens"] == 37  # answered requests only
    assert cached_of({"cached_tokens": 24, "prompt_tokens": 1300}) == "24 of 1,300"
    assert cached_of({"cached_tokens": 1024}) == "1,024" and cached_of({"cached_tokens": None}) == "-"


def _ignoring_sigint() -> subprocess.Popen:
    """A process that ignores Ctrl-C, as mlx_lm.server does when started from a background job."""
    code = "import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "1\n"  # its handler is in place
    return proc


def test_a_server_that_ignores_ctrl_c_is_stopped(monkeypatch) -> None:
    import signal

    from dctms.benchmark.serve_clients import stop_server

    proc = _ignoring_sigint()
    stop_server(proc, timeout_s=0.5)  # Ctrl-C, ignored; then SIGTERM
    assert proc.returncode == -signal.SIGTERM
    # started from a background job (SIGINT ignored here too): SIGTERM at once
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_IGN)
    proc = _ignoring_sigint()
    sent = []
    send = proc.send_signal
    monkeypatch.setattr(proc, "send_signal", lambda sig: sent.append(sig) or send(sig))
    stop_server(proc, timeout_s=30)
    assert sent == [signal.SIGTERM] and proc.returncode == -signal.SIGTERM


def test_batch_loop_accounts_for_every_step(tmp_path: Path) -> None:
    # bench/batch_loop.py: the serving load in process; its time is prefill + decode + the rest,
    # and the decode steps by busy rows add up to the session's own count.
    beta = build_tiny_models(tmp_path)["beta"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "batch_loop.py"), "--model", str(beta.folder),
         "-N", "256", "-M", "8", "--batch", "2", "--requests", "5", "--max-tokens", "6",
         "--compare-moves", "--mlx-lm"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours_out, theirs_out = proc.stdout.split("-- mlx-lm BatchGenerator")
    blocks = ours_out.split("-- with")[1:]  # with slot moves, then without
    assert [b.split("\n", 1)[0] for b in blocks] == [" slot moves", "out slot moves"]
    generated = []
    for block, moved in zip(blocks, (True, False), strict=True):
        lines = block.splitlines()[1:]
        assert lines[0].startswith("5 requests of up to 6 tokens over 2 slots, in process: ")
        generated.append(re.search(r": (\d+) tokens in", lines[0])[1])
        head = re.match(
            r"prefill calls: (\d+), [\d.]+ s; decode steps: (\d+), [\d.]+ s; "
            r"other [\d.]+ s \(slot moves: (\d+)\)",
            lines[1],
        )
        assert head and int(head[1]) >= 5
        assert moved or int(head[3]) == 0  # (whether a move happens depends on the load)
        by_rows = [re.match(r"  decode steps with ([12]) busy rows: (\d+), median", x) for x in lines[2:]]
        assert by_rows and all(by_rows)
        assert sum(int(m[2]) for m in by_rows) == int(head[2])
    assert generated[0] == generated[1]  # the same tokens either way
    # then mlx-lm's own continuous batching on the same load, in a child process, and the ratio
    lines = theirs_out.splitlines()
    assert lines[0] == ", 2 sequences at once, the same prompts"
    theirs = re.match(r"5 requests of up to 6 tokens, in process: \d+ tokens in [\d.]+ s, ([\d.]+) tok/s", lines[1])
    assert theirs, lines[1]
    assert re.match(r"prompt processing: \d+ tokens, [\d.]+ s; decode steps: \d+, [\d.]+ s", lines[2])
    ours = re.findall(r"([\d.]+) tok/s", blocks[0])[0]  # with slot moves: the runner as it is
    ratio = re.match(r"dctms / mlx-lm BatchGenerator: ([\d.]+) \(tok/s, one run\)", lines[3])
    assert ratio and float(ratio[1]) == pytest.approx(float(ours) / float(theirs[1]), abs=2e-3)


@pytest.mark.slow
def test_bench_runs_both_servers_end_to_end(tmp_path: Path) -> None:
    beta = build_tiny_models(tmp_path)["beta"]  # the tiny model with a chat template
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_vs_mlx_lm.py"), "--model", str(beta.folder),
         "-N", "256", "-M", "8", "--batch", "2", "--levels", "1,2", "--requests", "4",
         "--max-tokens", "4", "--under-limit", "--prefix-blocks", "16", "--prefill-chunk", "16",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for system in ("dctms", "mlx_lm"):
        levels = data["runs"][system]["levels"]
        assert [lv["clients"] for lv in levels] == [1, 2]
        assert all(lv["answered"] == lv["requests"] == 4 for lv in levels), levels
        assert all(lv["completion_tokens"] > 0 and lv["peak_rss"] > 0 for lv in levels)
    for lv in data["runs"]["dctms"]["levels"]:
        assert lv["polls"] > 0 and lv["polls_over_provable"] == 0
        assert lv["observed_peak"] <= lv["m_max_provable"]
        assert 0 < lv["model_observed_peak"] <= lv["m_max_provable"]
        # (a tiny request may start and end between two polls: no lower bound on the busy slots)
        assert lv["slots"] == 2 and lv["max_slots_busy"] <= 2 and lv["plan_m_max"] > 0
    assert "| 2 |" in proc.stdout  # the table's row for 2 clients
    # the plan kept a prefix pool (16 blocks hold the four prompts' whole chunks): dctms says what
    # it reused; the second level repeats the first one's prompts
    assert data["info"]["prefix_blocks"] == 16 and data["info"]["prefill_chunk"] == 16
    cached = [lv["cached_tokens"] for lv in data["runs"]["dctms"]["levels"]]
    assert None not in cached and cached[1] > 0, cached
    limited = data["under_limit"]["dctms"]
    if "skipped" not in limited:
        assert limited["oom_kills"] == 0 and limited["exit"] == 0
        assert all(lv["answered"] == lv["requests"] for lv in limited["levels"])
