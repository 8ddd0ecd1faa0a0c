"""``dctms roofline``: the per-primitive costs checked by hand on the demo config, the roofline times
and predictions, the command, and the comparison with a real ``dctms bench`` run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from dctms.cli import main as cli
from dctms.figures.op_costs import PhaseValues, op_cost, phase_costs
from dctms.figures.roofline import op_seconds, plan_roofline, prefill_calls
from dctms.schema.io import write_plan
from dctms.schema.model_folder import open_model
from dctms.schema.types import TargetProfile
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

N, M, CHUNK = 128, 64, 32
H, LAYERS, INTER, HEADS, KV_HEADS, VOCAB = 128, 4, 352, 4, 2, 257
HEAD_DIM = H // HEADS
CAPACITY = N + M  # 128 is a multiple of the chunk


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("roof")
    (folder / "config.json").write_text(json.dumps(DEMO_CONFIG))
    return compile_plan(open_model(folder), CompileOptions(N, M, prefill_chunk=CHUNK))


@pytest.fixture(scope="module")
def plan_file(plan, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("roof-plan") / "demo.plan"
    write_plan(plan, path)
    return path


def linear_macs_per_token() -> int:
    """q, k, v, o, gate, up, down per layer (the demo config, by hand)."""
    kv = KV_HEADS * HEAD_DIM
    return LAYERS * (H * H + 2 * H * kv + H * H + 3 * H * INTER)


def attention_macs_per_token(window: int = CAPACITY) -> int:
    """scores q.K and weights.V over the attention window (decode: N + M positions; prefill: the
    padded prompt, N here), every head, every layer."""
    return LAYERS * 2 * HEADS * window * HEAD_DIM


def rows(plan, phase: str) -> dict:
    return {r.op_class: r for r in plan_roofline(plan).phase(phase).rows}


def test_decode_matmul_flops_by_hand(plan):
    lm_head = H * VOCAB
    expected = 2 * (linear_macs_per_token() + attention_macs_per_token() + lm_head)
    assert rows(plan, "decode")["matmul"].flops == expected


def test_prefill_matmul_flops_by_hand(plan):
    # every linear layer and attention for all CHUNK tokens, the LM head for the last one only;
    # but the last layer's feed-forward and attention (scores, values) for the picked row alone
    # (toolkit.last_row): CHUNK - 1 rows of one layer's MLP and attention are not computed
    lm_head = H * VOCAB
    skipped = (CHUNK - 1) * (3 * H * INTER + attention_macs_per_token(N) // LAYERS)
    every_row = CHUNK * (linear_macs_per_token() + attention_macs_per_token(N))
    assert rows(plan, "prefill")["matmul"].flops == 2 * (every_row - skipped + lm_head)


def test_decode_reads_every_weight_once_and_the_whole_cache(plan):
    total = plan_roofline(plan).phase("decode").total
    embedding_row = H * 4  # the Gather reads one float32 row, not the table
    assert total.weights == plan.model.weights.total_bytes + embedding_row
    kv_update = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # keys and values of one token, in place
    assert total.kv == plan.envelope.kv + kv_update
    assert rows(plan, "decode")["gather"].weights == embedding_row


def test_views_move_nothing_and_every_op_is_counted(plan):
    for phase in plan.phases:
        costs = phase_costs(phase)
        assert len(costs) == len(phase.ops)
        views = [c for c in costs if c.op_class == "view"]
        assert views and all(c.flops == 0 and c.bytes == 0 for c in views)
        values = PhaseValues(phase)
        for op in phase.ops:  # a broadcast input is read at most as its storage's bytes
            cost = op_cost(op, values)
            if op.primitive == "Matmul":  # (plus the contiguous copy MLX makes of it: scratch)
                assert cost.bytes - cost.scratch <= sum(values.value(i).logical_bytes for i in op.inputs) + sum(
                    values.value(o).logical_bytes for o in op.outputs
                )


def profile(flops: float, bandwidth: float) -> TargetProfile:
    return TargetProfile("test", flops, "by hand", bandwidth, "by hand")


def test_roofline_time_is_the_slower_of_compute_and_memory(plan):
    values = PhaseValues(plan.phases[1])
    cost = next(op_cost(op, values) for op in plan.phases[1].ops if op.primitive == "Matmul")
    assert op_seconds(cost, profile(1e9, 1e18)) == pytest.approx(cost.flops / 1e9)
    assert op_seconds(cost, profile(1e18, 1e9)) == pytest.approx(cost.bytes / 1e9)
    # Decode (well under 1 FLOP/byte) is memory-bound on a ridge of 1000, compute-bound on one
    # below its intensity.
    roof = plan_roofline(plan, profile(1e12, 1e9))
    decode = roof.phase("decode").total
    assert decode.intensity is not None and decode.intensity < 1
    assert roof.ridge == 1000 and decode.bound(roof.ridge) == "memory"
    assert decode.bound(decode.intensity / 2) == "compute"


def test_predictions(plan):
    p = profile(2e9, 10e9)
    roof = plan_roofline(plan, p, prompt_tokens=70)
    assert roof.prefill_calls == [("prefill", math.ceil(70 / CHUNK))]
    assert roof.ttft_s == pytest.approx(3 * roof.phase("prefill").seconds)
    decode = roof.phase("decode")
    assert roof.decode_s == decode.seconds
    assert roof.decode_tokens_per_s == pytest.approx(1 / decode.seconds)
    assert decode.seconds == pytest.approx(
        math.fsum(op_seconds(c, p) for c in phase_costs(plan.phases[1]))
    )
    # Twice the bandwidth and twice the FLOP/s: exactly twice as fast.
    fast = plan_roofline(plan, profile(4e9, 20e9), prompt_tokens=70)
    assert fast.decode_tokens_per_s == pytest.approx(2 * roof.decode_tokens_per_s)
    assert fast.ttft_s == pytest.approx(roof.ttft_s / 2)


def test_prefill_calls_with_several_prefill_phases(plan):
    # A plan with a short prefill phase too: the remainder goes to the smallest that holds it.
    prefill = plan.phases[0]
    short = msgspec.structs.replace(prefill, name="prefill.8", tokens=8)
    two = msgspec.structs.replace(plan, phases=[prefill, short, plan.phases[1]])
    assert prefill_calls(two, 70) == [("prefill", 2), ("prefill.8", 1)]
    assert prefill_calls(two, 64) == [("prefill", 2)]
    assert prefill_calls(two, 20) == [("prefill", 1)]
    assert prefill_calls(two, 5) == [("prefill.8", 1)]


# ------------------------------------------------------------------------------------ the command


def test_roofline_text(plan_file, capsys):
    assert cli.main(["roofline", str(plan_file), "--prompt-tokens", "100"]) == 0
    out = capsys.readouterr().out
    # predicted on the BLAS dctms runs with, named at the top and beside the predicted times
    assert "profile cpu-x86-2core-openblas: ridge" in out
    assert "no dispatch overhead), on profile cpu-x86-2core-openblas" in out
    assert "phase prefill: 32 tokens per call" in out and "phase decode: 1 token per call" in out
    assert "TTFT for a 100-token prompt" in out and "(4 x prefill)" in out
    assert "tok/s per sequence" in out


def test_roofline_json_on_another_profile(plan, plan_file, capsys):
    assert cli.main(["roofline", str(plan_file), "--profile", "apple-m4-max", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["name"] == "apple-m4-max"
    assert "546" in doc["profile"]["bandwidth_source"]
    from dctms.toolkit.profiles import get_profile

    expected = plan_roofline(plan, get_profile("apple-m4-max"))
    assert doc["summary"]["decode_tokens_per_s"] == pytest.approx(expected.decode_tokens_per_s)
    decode = next(p for p in doc["phases"] if p["name"] == "decode")
    assert {c["op_class"] for c in decode["classes"]} >= {"matmul", "elementwise", "view"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-tokens", "129"], "--prompt-tokens must be between 1 and the plan's N = 128"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be between 1"),
        (["--compare-bench", "/nonexistent/summary.json"], "no such bench summary"),
    ],
)
def test_bad_input_exit_2(plan_file, capsys, argv, message):
    assert cli.main(["roofline", str(plan_file), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_not_a_bench_summary(plan_file, tmp_path, capsys):
    (tmp_path / "summary.json").write_text('{"format": "something else"}')
    assert cli.main(["roofline", str(plan_file), "--compare-bench", str(tmp_path)]) == 2
    assert "not a dctms bench summary" in capsys.readouterr().err


def test_measured_profile_names_its_blas():
    from dctms.benchmark.machine import measured_profile

    p = measured_profile(read_bytes=8 * 2**20, matmul_n=128, repeats=2)
    assert p.peak_flops > 1e6 and p.bandwidth_bytes_per_s > 1e7
    assert "BLAS loaded:" in p.peak_flops_source and "8 MiB" in p.bandwidth_source


@pytest.mark.slow
def test_compare_with_a_real_bench_run(tmp_path, capsys):
    folder = write_tiny_model(tmp_path / "model", DEMO_CONFIG)
    plan = compile_plan(open_model(folder), CompileOptions(2048, 8, prefill_chunk=256))
    plan_path = tmp_path / "p.plan"
    write_plan(plan, plan_path)
    out = tmp_path / "bench"
    argv = ["bench", str(plan_path), "--model", str(folder), "--reps", "1", "--max-tokens", "4"]
    assert cli.main([*argv, "--out", str(out), "--no-plot", "-q", "--resamples", "50"]) == 0
    capsys.readouterr()
    assert cli.main(["roofline", str(plan_path), "--compare-bench", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "summary.json").read_text())
    rows = doc["bench"]["ttft"]
    assert [r["prompt"] for r in rows] == [p["id"] for p in summary["prompts"]]
    for r, p in zip(rows, summary["prompts"], strict=True):
        assert r["tokens"] == p["tokens"]
        assert r["ttft_measured_ms"] == summary["per_prompt"][p["id"]]["runner"]["ttft_mean_ms"]
        assert r["ratio"] == pytest.approx(r["ttft_predicted_ms"] / r["ttft_measured_ms"])
    decode = doc["bench"]["decode"]
    assert decode["measured_tokens_per_s"] == summary["systems"]["runner"]["decode_tokens_per_s"]
    assert decode["ratio"] == pytest.approx(
        decode["measured_tokens_per_s"] / decode["predicted_tokens_per_s"]
    )
