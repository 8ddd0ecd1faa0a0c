"""`dctms diff`'s intermediate bytes by module: the peak's bytes split by module, layers as *."""

from __future__ import annotations

import json

import msgspec
import pytest
from conftest import TINY_QWEN2

import dctms
from dctms.cli.main import main as cli
from dctms.figures.module_diff import layer_wildcard, module_deltas
from dctms.schema.io import write_plan


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diff")
    config = folder / "config.json"
    config.write_text(json.dumps(TINY_QWEN2))
    old = dctms.compile_plan(config, 16, 8, real_lengths=False)
    new = dctms.compile_plan(config, 16, 8, prefill_chunk=8, real_lengths=False)
    write_plan(old, folder / "old.plan")
    write_plan(new, folder / "new.plan")
    return old, new, folder


def test_layer_wildcard():
    assert layer_wildcard("model.layers.12.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert layer_wildcard("lm_head") == "lm_head"


def test_peak_changes_add_up_to_the_lower_bound_change(pair):
    old, new, _ = pair
    rows = module_deltas(old, new)
    assert rows and {r.phase for r in rows} <= {"prefill", "decode"}
    for o, n in zip(old.phases, new.phases, strict=True):
        mine = [r for r in rows if r.phase == o.name]
        assert sum(r.peak_delta for r in mine) == n.lower_bound_bytes - o.lower_bound_bytes
    # halving the chunk shrinks the attention's intermediates
    attn = next(r for r in rows if r.phase == "prefill" and r.module == "model.layers.*.self_attn")
    assert attn.bytes_delta < 0
    assert module_deltas(old, old) == []


def test_no_rows_without_module_paths(pair):
    old, new, _ = pair
    assert (
        module_deltas(
            msgspec.structs.replace(
                old,
                modules=None,
                phases=[msgspec.structs.replace(p, modules=None) for p in old.phases],
            ),
            new,
        )
        == []
    )


def test_cli_shows_the_module_table(pair, capsys):
    _, _, folder = pair
    assert cli(["diff", str(folder / "old.plan"), str(folder / "new.plan")]) == 0
    out = capsys.readouterr().out
    assert "intermediate bytes by module" in out and "model.layers.*.self_attn" in out
    assert (
        cli(["diff", str(folder / "old.plan"), str(folder / "new.plan"), "--format", "json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["modules"] and {"phase", "module", "peak_delta", "bytes_delta"} <= set(
        data["modules"][0]
    )
    assert (
        cli(["diff", str(folder / "old.plan"), str(folder / "new.plan"), "--format", "markdown"])
        == 0
    )
    assert "| `model.layers.*.self_attn` | prefill |" in capsys.readouterr().out
