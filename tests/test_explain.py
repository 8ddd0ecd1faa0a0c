"""`dctms explain`: the envelope's parts by module, what drives them, the peaks, and knobs measured
by re-compiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.cli.main import main as cli
from dctms.figures.explain import KnobEffect, explain, knob_effect, weight_group
from dctms.schema.io import write_plan
from dctms.schema.modules import node_paths

N, M = 16, 8
COMPONENTS = ("weights", "kv", "persistent", "intermediate", "runtime")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return path


@pytest.fixture(scope="module")
def plan(config_path):
    return dctms.compile_plan(config_path, N, M, real_lengths=False)


@pytest.fixture(scope="module")
def plan_path(plan, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.plan"
    write_plan(plan, path)
    return path


def test_weight_groups():
    assert weight_group("model.layers.3.mlp.down_proj.scales") == "model.layers.*.mlp"
    assert weight_group("model.layers.0.input_layernorm.weight") == "model.layers.*.input_layernorm"
    assert weight_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert weight_group("lm_head.biases") == "lm_head"


def test_parts_add_up_to_each_component(plan):
    ex = explain(plan)
    for component in COMPONENTS:
        parts = [p.bytes for p in ex.parts if p.component == component]
        assert sum(parts) == getattr(plan.envelope, component), component
    assert sum(p.bytes for p in ex.parts) == plan.envelope.total == ex.total
    mlp = next(p for p in ex.parts if p.what == "model.layers.*.mlp")
    assert mlp.count == TINY_QWEN2["num_hidden_layers"]
    kv = [p for p in ex.parts if p.component == "kv"]
    assert [p.what for p in kv] == ["layers 0-1"] and kv[0].count == 2


def test_peaks_are_the_lower_bounds_split_by_module(plan):
    ex = explain(plan)
    paths = set(node_paths(plan.modules))
    assert [pk.phase for pk in ex.peaks] == [p.name for p in plan.phases]
    for pk, phase in zip(ex.peaks, plan.phases, strict=True):
        assert pk.bytes == phase.lower_bound_bytes
        assert sum(m.bytes for m in pk.modules) == pk.bytes
        assert all(m.module in paths for m in pk.modules)
        assert pk.modules == sorted(pk.modules, key=lambda m: (-m.bytes, m.module))
        assert all(isinstance(t.shape, tuple) and t.dtype and t.module in paths for t in pk.tensors)
    only = explain(plan, "decode")
    assert [pk.phase for pk in only.peaks] == ["decode"]


def test_drivers_name_the_bounds(plan):
    drivers = {d.component: d for d in explain(plan).drivers}
    assert "N + M + 1 = 16 + 8 + 1" in drivers["kv"].sentence
    assert set(drivers["kv"].bounds) >= {"N", "M", "batch"}
    assert "chunk" in drivers["intermediate"].bounds or "M" in drivers["intermediate"].bounds


def test_knob_sentence():
    effect = KnobEffect(
        "chunk", 512, 256, {"intermediate": -3 * 2**20, "kv": 0, "total": -3 * 2**20}
    )
    assert effect.sentence() == (
        "chunk 512 -> 256 lowers M_intermediate by 3.00 MiB (M_max -3.00 MiB)"
    )
    assert KnobEffect("M", 8, 4, {"total": 0}).sentence() == "M 8 -> 4: no change to M_max"


def test_knob_effect_is_the_envelope_difference(plan):
    assert knob_effect("N", N, N, plan, plan).changes == dict.fromkeys((*COMPONENTS, "total"), 0)


# ------------------------------------------------------------------------------------ the CLI


def test_cli_text_names_modules_and_shapes(plan_path, capsys):
    assert cli(["explain", str(plan_path), "--no-knobs"]) == 0
    out = capsys.readouterr().out
    assert "prefill peak" in out and "decode peak" in out
    assert "model.layers.*.mlp" in out and "layers 0-1" in out
    assert "what each knob changes" not in out  # no compiles asked for


def test_cli_knob_measured_by_a_real_compile(plan_path, config_path, plan, capsys):
    assert cli(["explain", str(plan_path), "--knobs", "chunk", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [knob] = data["knobs"]
    chunk = plan.bounds.prefill_chunk
    assert (knob["knob"], knob["old"], knob["new"]) == ("chunk", chunk, chunk // 2)
    smaller = dctms.compile_plan(config_path, N, M, prefill_chunk=chunk // 2, real_lengths=False)
    for c in COMPONENTS:
        assert knob["changes"][c] == getattr(smaller.envelope, c) - getattr(plan.envelope, c)
    assert knob["changes"]["intermediate"] < 0  # a smaller chunk, a smaller prefill arena
    assert knob["sentence"].startswith(f"chunk {chunk} -> {chunk // 2} lowers M_intermediate")
    assert data["peaks"][0]["modules"][0]["module"]


def test_cli_bad_input(plan_path, plan_file, tmp_path, capsys):
    assert cli(["explain", str(plan_path), "--phase", "nope", "--no-knobs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--phase nope" in err[0] and "prefill, decode" in err[0]
    assert cli(["explain", str(plan_path), "--knobs", "chunk,bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown knob 'bogus'" in err[0]
    # a plan without a recorded request: the plan alone works, knobs are refused in one line
    assert cli(["explain", str(plan_file), "--no-knobs"]) == 0
    capsys.readouterr()
    assert cli(["explain", str(plan_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no compile request" in err[0]
    assert cli(["explain", str(tmp_path / "missing.plan")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
