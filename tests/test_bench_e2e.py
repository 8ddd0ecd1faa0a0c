"""dctms bench end to end on a tiny random-weight qwen2 model (the demo's architecture and byte
tokenizer, smaller so the whole five-prompt bench stays well under a minute)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dctms.benchmark import systems as systems_mod
from dctms.benchmark.prompts import default_prompts_file, load_prompts
from dctms.cli.main import main
from dctms.schema.io import write_plan
from dctms.schema.model_folder import open_model
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

SMALL = dict(
    DEMO_CONFIG,
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, plan for N = 2048 / M = 8): P5 is ~1,770 byte tokens."""
    root = tmp_path_factory.mktemp("bench-model")
    folder = write_tiny_model(root / "model", SMALL)
    plan = compile_plan(
        open_model(folder), CompileOptions(input_tokens=2048, output_tokens=8, prefill_chunk=256)
    )
    plan_path = root / "bench.plan"
    write_plan(plan, plan_path)
    return folder, plan_path


@pytest.mark.slow
def test_bench_end_to_end(bench_model, tmp_path: Path, capsys):
    folder, plan = bench_model
    out = tmp_path / "out"
    rc = main(
        ["bench", str(plan), "--model", str(folder), "--reps", "1", "--max-tokens", "4"]
        + ["--out", str(out), "--resamples", "300"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "| mlx-lm baseline |" in captured.out and "| runner ÷ baseline |" in captured.out
    assert "bench [" in captured.err  # the progress bar

    for name in ("calls.json", "summary.md", "summary.json", "bench.png", "bench.svg"):
        assert (out / name).is_file(), name
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (out / "bench.svg").read_text()

    calls_doc = json.loads((out / "calls.json").read_text())
    assert calls_doc["status"] == "complete"
    calls = calls_doc["calls"]
    prompt_ids = [p.id for p in load_prompts(default_prompts_file())]
    assert [(c["prompt"], c["system"]) for c in calls] == [
        (pid, sys) for pid in prompt_ids for sys in ("baseline", "runner")
    ]
    assert len(calls_doc["warmup"]) == 2
    p5 = next(p for p in calls_doc["prompts"] if p["id"] == "P5")
    assert p5["tokens"] == p5["text_bytes"] > 1500  # byte tokenizer: one token per byte
    for c in calls:
        assert 0 < c["ttft_s"] <= c["latency_s"] < 120
        assert 1 <= c["tokens_generated"] == len(c["tokens"]) <= 4
        assert c["rss_peak_bytes"] >= c["rss_start_bytes"] > 10 * 2**20
        assert c["mlx_peak_bytes"] > 0
        assert len(c["rss_series"]) >= 2

    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed_calls"] == summary["planned_calls"] == 10
    for sys in ("baseline", "runner"):
        mine = [c for c in calls if c["system"] == sys]
        d = summary["systems"][sys]
        assert d["n"] == 5
        assert d["mean_ms"] == pytest.approx(sum(c["latency_s"] for c in mine) / 5 * 1000)
        assert d["tokens_per_s"] == pytest.approx(
            sum(c["tokens_generated"] for c in mine) / sum(c["latency_s"] for c in mine)
        )
        assert d["rss_peak_bytes"] == max(c["rss_peak_bytes"] for c in mine)
        assert d["cv"] > 0
        for c in mine:  # one call per prompt: its figures are the call's
            assert summary["per_prompt"][c["prompt"]][sys]["mean_ms"] == pytest.approx(
                c["latency_s"] * 1000
            )
    ratio = summary["ratios"]["all"]["mean_ms"]
    assert ratio["ratio"] == pytest.approx(
        summary["systems"]["runner"]["mean_ms"] / summary["systems"]["baseline"]["mean_ms"]
    )
    # One call per prompt and system: no bootstrap interval (resampling would only repeat it).
    assert ratio["low"] is None and ratio["high"] is None
    # Greedy on the same weights: the plan runner reproduces mlx-lm's tokens.
    assert all(g["identical"] for g in summary["greedy_agreement"].values())

    md = (out / "summary.md").read_text()
    base = summary["systems"]["baseline"]
    assert (
        f"| mlx-lm baseline | {base['mean_ms']:,.1f} | {base['std_ms']:,.1f} | {base['cv']:.3f}"
        in md
    )
    assert "![latency and RSS](bench.png)" in md
    assert "two copies of the weights" in md
    # the default order: balanced over the repetitions
    assert "loaded runner first for odd repetitions" in summary["settings"]["process"]
    # a CPU plan counts no allocator slack: the settings say the runner's cache is off, as it is
    assert "MLX buffer cache off" in summary["settings"]["runner"]


@pytest.mark.slow
def test_bench_can_load_the_baseline_first(bench_model, tmp_path: Path, capsys):
    folder, plan = bench_model
    out = tmp_path / "out"
    rc = main(
        ["bench", str(plan), "--model", str(folder), "--reps", "1", "--max-tokens", "2"]
        + ["--out", str(out), "--resamples", "100", "--no-plot", "-q"]
        + ["--load-order", "baseline-first"]
    )
    assert rc == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["process"].endswith("loaded baseline first")
    assert all(g["identical"] for g in summary["greedy_agreement"].values())
    # the runner measures its own memory: the baseline loaded before it is not counted
    assert all(row["within_envelope"] for row in summary["parity"])
    with pytest.raises(SystemExit) as refused:  # argparse's one-line usage error
        main(["bench", str(plan), "--model", str(folder), "--load-order", "never"])
    assert refused.value.code == 2


@pytest.mark.slow
def test_bench_reloads_in_the_other_order_between_repetitions(bench_model, tmp_path: Path, capsys):
    """The default ``alternate``: real systems re-loaded before repetition 2 (baseline first),
    warmed up again; both repetitions agree and every runner call stays within the envelope,
    the re-loaded copies counted (no leftover of the first pair)."""
    folder, plan = bench_model
    out = tmp_path / "out"
    rc = main(
        ["bench", str(plan), "--model", str(folder), "--reps", "2", "--max-tokens", "3"]
        + ["--out", str(out), "--resamples", "100", "--no-plot", "-q"]
    )
    assert rc == 0, capsys.readouterr().err
    calls = json.loads((out / "calls.json").read_text())
    assert [w["before_rep"] for w in calls["warmup"]] == [0, 0, 1, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert all(g["identical"] for g in summary["greedy_agreement"].values())
    assert all(row["within_envelope"] for row in summary["parity"])
    held = {
        c["rep"]: c["mlx_active_before_bytes"] for c in calls["calls"] if c["system"] == "runner"
    }
    assert held[1] <= held[0] * 1.01  # the first pair's weights were freed before the second load


def test_interrupt_without_tokenizer_exits_130_with_partial_result(
    bench_model, tmp_path: Path, capsys, monkeypatch
):
    folder, plan = bench_model
    bare = tmp_path / "bare"  # the same weights, no tokenizer.json
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    real = systems_mod.measure_call
    done = []

    def measure(system, ids, max_tokens, stop):
        if len(done) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the fourth call
        done.append(ids)
        return real(system, ids, max_tokens, stop)

    monkeypatch.setattr(systems_mod, "measure_call", measure)
    out = tmp_path / "out"
    rc = main(
        ["bench", str(plan), "--model", str(bare), "--reps", "2", "--max-tokens", "2"]
        + ["--warmup", "0", "--out", str(out), "--no-plot", "-q"]
    )
    captured = capsys.readouterr()
    assert rc == 130
    assert "interrupted after 3 of 20 calls" in captured.err
    doc = json.loads((out / "calls.json").read_text())
    assert doc["status"] == "interrupted" and len(doc["calls"]) == 3
    assert "UTF-8 bytes modulo the vocabulary size (257)" in doc["settings"]["tokenization"]
    text = load_prompts(default_prompts_file())[0].text
    assert done[0] == done[1] == list(text.encode("utf-8"))  # P1 for both systems
    assert doc["settings"]["stop"].startswith("none")
    md = (out / "summary.md").read_text()
    assert "3 of 20 calls completed" in md
    assert not (out / "bench.png").exists()


def test_refusals_before_loading(bench_model, tmp_path: Path, capsys):
    folder, _ = bench_model
    small = compile_plan(
        open_model(folder), CompileOptions(input_tokens=128, output_tokens=8, prefill_chunk=32)
    )
    plan = tmp_path / "n128.plan"
    write_plan(small, plan)
    p5 = len(load_prompts(default_prompts_file())[4].text.encode("utf-8"))

    assert main(["bench", str(plan), "--model", str(folder), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"P5 (longer-context comprehension) has {p5} tokens" in err and "N = 128" in err
    assert not (tmp_path / "o").exists()

    rc = main(["bench", str(plan), "--model", str(folder), "--max-tokens", "9"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--max-tokens 9 exceeds the plan's M = 8" in err

    rc = main(["bench", str(plan), "--model", str(folder), "--reps", "0"])
    assert rc == 2 and "--reps must be at least 1" in capsys.readouterr().err
